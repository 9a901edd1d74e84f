"""How long does the one-call attention take? The kernel alone (attention.c), by cached tokens and rows
per sequence, for this tree's build and optionally for the kernel of other git revisions.

A decoding pass's rows attend to every cached token, so their cost grows with the context
(docs/performance.md#a-pass-at-long-context). This times ``medusa_rows_attention`` on random keys
and queries of the target's attention shape (one sequence whose rows form a chain, as a lookup
chain or a tree's path), as many calls as the model has layers, and checks every build gives the
same outputs to float32 rounding. ``--against REV`` builds that revision's attention.c (with its
pool.c and vec.h) into a temporary folder with the same flags; builds are timed in turn, round
after round, and the fastest round of each is reported.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from medusa.config import HelpFormatter, count
from medusa.runtime import gemv, rows

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ("medusa/runtime/attention.c", "medusa/runtime/pool.c", "medusa/runtime/vec.h")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/time_attention.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--prefix", default="256,1024,2048,4096,8000", help="cached tokens, comma-separated")
    ap.add_argument("--rows", default="1,8,16", help="rows per pass (one sequence), comma-separated")
    ap.add_argument("--heads", type=count(), default=9, help="query heads (default: SmolLM2-135M's)")
    ap.add_argument("--kv-heads", type=count(), default=3, help="key/value heads")
    ap.add_argument("--head-dim", type=count(), default=64, help="head size")
    ap.add_argument("--layers", type=count(), default=30, help="calls per timed pass (the model's layers)")
    ap.add_argument("--rounds", type=count(), default=5, help="timed rounds per build (the fastest is reported)")
    ap.add_argument("--reps", type=count(), default=10, help="passes per round")
    ap.add_argument("--against", action="append", default=[],
                    help="also time the kernel of this git revision (repeatable), e.g. HEAD~2")
    ap.add_argument("--json", default=None, help="also write the results as JSON here (default: printed only)")
    return ap


def build_revision(rev: str, folder: Path) -> ctypes.CDLL:
    """``rev``'s attention kernel built into ``folder`` with the runtime's flags."""
    lib = gemv.build_at(rev, KERNEL, folder, ROOT)
    lib.medusa_rows_attention.argtypes = gemv.library().medusa_rows_attention.argtypes
    lib.medusa_rows_attention.restype = ctypes.c_int
    return lib


def case(past: int, n: int, heads: int, kv_heads: int, dim: int) -> tuple[tuple, torch.Tensor, list]:
    """The kernel's arguments for ``n`` chained rows after ``past`` cached tokens; its output; what they point to."""
    gen = torch.Generator().manual_seed(past * 100 + n)
    keys = torch.randn(1, kv_heads, past + n, dim, generator=gen)
    values = torch.randn(1, kv_heads, past + n, dim, generator=gen)
    q = torch.randn(1, heads, n, dim, generator=gen)
    plan = rows.layout([(past, torch.ones(n, n, dtype=torch.bool).tril_(), torch.arange(n))])
    k_at, v_at = (ctypes.c_int64 * 1)(keys.data_ptr()), (ctypes.c_int64 * 1)(values.data_ptr())
    strides = (ctypes.c_int64 * 2)(keys.stride(1), keys.stride(2))
    out = torch.empty(n, heads, dim)
    args = (q.data_ptr(), q.stride(1), q.stride(2), n, heads, kv_heads, dim, dim ** -0.5, ctypes.addressof(k_at),
            ctypes.addressof(v_at), ctypes.addressof(strides), ctypes.addressof(strides) + 8, plan.seg.data_ptr(),
            plan.lo.data_ptr(), plan.hi.data_ptr(), plan.start.data_ptr(), plan.extra.data_ptr(), out.data_ptr(),
            torch.get_num_threads())
    return args, out, [keys, values, q, plan, k_at, v_at, strides]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        prefixes = [int(x) for x in args.prefix.split(",")]
        sizes = [int(x) for x in args.rows.split(",")]
    except ValueError:
        raise SystemExit("error: --prefix and --rows take comma-separated whole numbers, e.g. --rows 1,8,16") from None
    if args.heads % args.kv_heads:
        raise SystemExit(f"error: --heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    reason = gemv.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"error: {reason}")
    builds = {"this tree": gemv.library()}
    with tempfile.TemporaryDirectory() as tmp:
        for rev in args.against:
            builds[rev] = build_revision(rev, Path(tmp))
        results = []
        for past in prefixes:
            for n in sizes:
                call, out, keep = case(past, n, args.heads, args.kv_heads, args.head_dim)
                outputs, best = {}, dict.fromkeys(builds, float("inf"))
                for name, lib in builds.items():
                    if lib.medusa_rows_attention(*call) != 0:
                        raise SystemExit(f"error: {name}'s kernel does not take {args.heads} heads over "
                                         f"{args.kv_heads} of size {args.head_dim}")
                    outputs[name] = out.clone()
                for _ in range(args.rounds):
                    for name, lib in builds.items():
                        time.sleep(0.01)  # the other build's workers stop spinning first
                        t0 = time.perf_counter()
                        for _ in range(args.reps * args.layers):
                            lib.medusa_rows_attention(*call)
                        best[name] = min(best[name], (time.perf_counter() - t0) / args.reps)
                first = outputs["this tree"]
                row = {"cached": past, "rows": n, "ms_per_pass": {k: v * 1e3 for k, v in best.items()},
                       "max_abs_diff": {k: float((o - first).abs().max()) for k, o in outputs.items()}}
                results.append(row)
                others = "".join(f"; {k} {v * 1e3:.2f} ms ({v / best['this tree']:.2f}x this tree's time)"
                                 for k, v in best.items() if k != "this tree")
                print(f"{past:6d} cached, {n:3d} rows: this tree {best['this tree'] * 1e3:.2f} ms a pass{others}",
                      flush=True)
                bad = [k for k, d in row["max_abs_diff"].items() if d > 1e-4]
                if bad:
                    print(f"  outputs differ beyond float32 rounding: {', '.join(bad)}", file=sys.stderr)
                del keep
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": {"heads": args.heads, "kv_heads": args.kv_heads,
                                                         "head_dim": args.head_dim, "layers": args.layers},
                                               "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
