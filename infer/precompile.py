"""``python -m infer.precompile``: compile this machine's verification passes and save them.

On a CPU compiled passes decode faster than eager ones (3-16% end to end in float32 on AMD
EPYCs, docs/compile.md#compiled; 12-15% per pass in bfloat16 on the AMX Xeon, bit-identical to eager,
docs/compile.md#compiled-exact-passes), but compiling one pass size of the embedded model takes about a
minute on a 2-core CPU. So nothing compiles inside the chat: with ``--compile auto`` (its default) the chat
answers eagerly and builds the sizes that are not saved yet in the background, at low priority
(``Engine.build_passes``, medusa/decoding/passes/build.py, the library code this command wraps);
once all are, the running chat's next answer is compiled, and later starts load them.

Run it by hand to have the passes ready before a first chat or benchmark::

    python -m infer.precompile                       # the embedded model, the chat's default mode
    python -m infer.precompile --model DIR --mode baseline

The saved files depend on the model's config, dtype, linear kernels and thread count, so
``--dtype``, ``--kernels`` and ``--threads`` must be what the decoding process uses (by
default the dtype is picked as ``medusa.load`` picks it). One build at a time runs per model and thread count: a second one says
which process holds the lock and exits.

Exit codes: 0 done (or another process is building), 1 a problem the user can fix, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys

from medusa.config import HelpFormatter, count
from medusa.runtime.kernels import kernels_arg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.precompile", description="Compile the verification passes "
                                "this machine decodes with and save them, so later processes load them in seconds.",
                                formatter_class=HelpFormatter)
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
    p.add_argument("--threads", type=count(1), help="torch threads, as the decoding process runs (default: torch's)")
    p.add_argument("--nice", type=int, default=0, help="lower this process's priority by this much")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the Hub")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.sizes is not None:
        try:  # checked here, before torch is imported
            args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
        except ValueError:
            p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
        if not args.sizes or min(args.sizes) < 1:
            p.error("--sizes must name at least one size, each at least 1")
        if args.mode is not None:
            p.error("give --sizes or --mode, not both")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    import torch

    import medusa
    from medusa.decoding.passes.build import build_here
    from medusa.errors import MedusaError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = medusa.load(args.model, heads=args.heads, device="cpu", dtype=args.dtype, compile=True,
                             kernels=args.kernels, trust_remote_code=args.trust_remote_code)
        mode = args.mode or ("hybrid" if engine.heads is not None else "baseline")
        sizes = args.sizes or engine.pass_sizes(mode)
        return build_here(engine.passes, sizes, engine.kernel_scope(), args.model or "the embedded model")
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
