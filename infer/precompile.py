"""``python -m infer.precompile``: compile this machine's verification passes and save them.

On a CPU compiled passes decode faster than eager ones (in float32: docs/compile.md#compiled; in
bfloat16, bit-identical to eager: docs/compile.md#compiled-exact-passes), but compiling one pass
size of the embedded model takes about a minute on a small CPU (the same page). So nothing
compiles inside the chat: with ``--compile auto`` (its default) the chat
answers eagerly and builds the sizes that are not saved yet in the background, at low priority
(``Engine.build_passes``, medusa/decoding/passes/build.py, the library code this command wraps);
once all are, the running chat's next answer is compiled, and later starts load them.

Run it by hand to have the passes ready before a first chat or benchmark::

    python -m infer.precompile                       # the embedded model, the chat's default mode
    python -m infer.precompile --model DIR --mode baseline

The saved files depend on the model's config, dtype, linear kernels and thread count, so
``--dtype``, ``--kernels`` and ``--threads`` must be what the decoding process uses (by
default the dtype is picked as ``medusa.load`` picks it). With ``--exact`` as well the target
loads alone, without heads or the machine plan, as in the build the chat starts in the
background (``python -m medusa.decoding.passes.build``, the library's entry point, with this
same parser: medusa/decoding/passes/build_args.py). One build at a time runs per model and
thread count: a second one says which process holds the lock and exits.

Exit codes: 0 done (or another process is building), 1 a problem the user can fix, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys

from medusa.decoding.passes import build_args


def build_parser() -> argparse.ArgumentParser:
    return build_args.build_parser("python -m infer.precompile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_args.parse_args(argv, build_parser())  # checked before torch's models load


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    import torch

    import medusa
    from medusa.decoding.passes.build import build_here, build_target
    from medusa.errors import MedusaError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.exact is not None:  # everything the files depend on given: the target alone
            return build_target(args)
        engine = medusa.load(args.model, heads=args.heads, device="cpu", dtype=args.dtype, compile=True,
                             kernels=args.kernels, trust_remote_code=args.trust_remote_code)
        sizes = args.sizes or engine.pass_sizes(args.mode or engine.default_mode)
        return build_here(engine.passes, sizes, engine.kernel_scope(), args.model or "the embedded model")
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
