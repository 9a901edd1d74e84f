"""The saved passes' build command line: the one parser behind ``python -m infer.precompile`` and
the build process :func:`~medusa.decoding.passes.build.start_build` starts, and its pass sizes.

Kept apart from medusa/decoding/passes/build.py so that a bad ``--sizes`` is a usage error
before transformers and the passes' code import (seconds on a small CPU).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from medusa.config import HelpFormatter, count
from medusa.runtime.kernels import kernels_arg


def parse_sizes(text: str) -> list[int]:
    """``"8,12,16"`` -> ``[8, 12, 16]`` (sorted, distinct, each at least 1); ValueError otherwise,
    its message the one line a usage error says."""
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError("--sizes must name at least one size, each at least 1")
    return sizes


def sizes_text(sizes: Sequence[int]) -> str:
    """``[8]`` -> ``"size 8"``, ``[8, 12]`` -> ``"sizes 8, 12"``."""
    return f"size{'s' if len(sizes) != 1 else ''} {', '.join(map(str, sizes))}"


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Compile the verification passes this machine decodes with "
                                "and save them, so later processes load them in seconds.", formatter_class=HelpFormatter)
    p.add_argument("--model", help="model folder, Hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--heads", help="heads folder or Hub id, which set the sizes of --mode (default: the embedded "
                                   "model's shipped heads)")
    p.add_argument("--mode", help="compile the pass sizes of this mode (default: hybrid with heads, else baseline)")
    p.add_argument("--sizes", help="comma-separated pass sizes to compile instead of a mode's, e.g. 8,12,16 "
                                   "(default: the mode's)")
    p.add_argument("--kernels", type=kernels_arg,
                   help="linear kernels, as the decoding process runs them (default: the pick measured on this machine)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the target's dtype, as the decoding process runs it (default: the pick measured on this machine)")
    p.add_argument("--exact", choices=("on", "off"),
                   help="exact attention, as the decoding process runs it; given, the target loads alone, without "
                        "heads or the machine plan, and --model, --sizes, --kernels and --dtype must be given too "
                        "(as in the chat's background build) (default: as the machine plan picks it)")
    p.add_argument("--threads", type=count(1), help="torch threads, as the decoding process runs (default: torch's)")
    p.add_argument("--nice", type=int, default=0, help="lower this process's priority by this much")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the Hub")
    return p


def parse_args(argv: list[str] | None, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments, ``--sizes`` as a list, checked before anything heavy loads (usage
    errors exit 2)."""
    args = parser.parse_args(argv)
    if args.sizes is not None:
        try:
            args.sizes = parse_sizes(args.sizes)
        except ValueError as err:
            parser.error(str(err))
        if args.mode is not None:
            parser.error("give --sizes or --mode, not both")
    if args.exact is not None and None in (args.model, args.sizes, args.kernels, args.dtype):
        parser.error("--exact loads the target alone: give --model, --sizes, --kernels and --dtype with it")
    return args
