"""How long do the gemv kernels' products take? The kernel alone (gemv.c), by weight and rows, for
this tree's build and optionally for the kernel of other git revisions.

A decoding pass's products read every weight once for a handful of rows, so a product's time is
about its weight's bytes over the machine's read bandwidth, unless the kernel's own loop is slower
than the memory (docs/performance.md#gemv-kernels). This times ``medusa_gemv`` (float32 weights)
and ``medusa_gemv_bf16`` (bfloat16 weights: the heads' products, their draft vocabulary and the
vocabulary screen) on random weights of the embedded model's shapes, and checks that every build
gives the same bits. ``--against REV`` builds that revision's gemv.c (with its pool.c) into a
temporary folder with the same flags; builds are timed in turn, round after round, and the fastest
round of each is reported.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time
from pathlib import Path

import torch

from medusa.config import HelpFormatter, count
from medusa.runtime import gemv

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ("medusa/runtime/gemv.c", "medusa/runtime/pool.c")
# the embedded SmolLM2-135M's weights as the kernels see them, [out, in]: its vocabulary projection,
# the screen's and the heads' draft vocabulary, and an EAGLE-3 drafter layer's stacked products
SHAPES = {"lm_head": (49152, 576), "draft_vocab": (8192, 576), "qkv": (960, 1152), "o": (576, 576),
          "gate_up": (3072, 576), "down": (576, 1536)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/time_gemv.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--weights", default="lm_head,draft_vocab,qkv,gate_up",
                    help=f"weights to time, comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="weight dtypes: bfloat16, float32 or both")
    ap.add_argument("--rows", default="1,2,4,8", help="rows per product, comma-separated")
    ap.add_argument("--rounds", type=count(), default=5, help="timed rounds per build (the fastest is reported)")
    ap.add_argument("--reps", type=count(), default=20, help="products per round")
    ap.add_argument("--against", action="append", default=[],
                    help="also time the kernel of this git revision (repeatable), e.g. HEAD~1")
    ap.add_argument("--json", default=None, help="also write the results as JSON here (default: printed only)")
    return ap


def build_revision(rev: str, folder: Path) -> ctypes.CDLL:
    """``rev``'s gemv kernel built into ``folder`` with the runtime's flags."""
    lib = gemv.build_at(rev, KERNEL, folder, ROOT)
    for name in ("medusa_gemv", "medusa_gemv_bf16"):
        getattr(lib, name).argtypes = getattr(gemv.library(), name).argtypes
        getattr(lib, name).restype = None
    return lib


def parse(args: argparse.Namespace) -> tuple[list[str], list[torch.dtype], list[int]]:
    names = [w.strip() for w in args.weights.split(",") if w.strip()]
    unknown = [w for w in names if w not in SHAPES]
    if unknown:
        raise SystemExit(f"error: unknown weight(s) {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    wanted = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not wanted or any(d not in dtypes for d in wanted):
        raise SystemExit(f"error: --dtypes takes bfloat16 and/or float32, not {args.dtypes!r}")
    try:
        sizes = [int(x) for x in args.rows.split(",")]
    except ValueError:
        raise SystemExit("error: --rows takes comma-separated whole numbers, e.g. --rows 1,2,4,8") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit("error: --rows takes counts of at least 1")
    return names, [dtypes[d] for d in wanted], sizes


def time_case(builds: dict[str, ctypes.CDLL], weight: torch.Tensor, n: int, rounds: int, reps: int) -> dict:
    """Every build's fastest round for ``n`` random rows times ``weight``, and their outputs' differences."""
    out_features, in_features = weight.shape
    packed = gemv.pack(weight)
    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(n))
    outs = {name: torch.empty(n, out_features) for name in builds}
    fn = "medusa_gemv_bf16" if weight.dtype == torch.bfloat16 else "medusa_gemv"
    calls = {name: (getattr(lib, fn), (x.data_ptr(), n, in_features, packed.data_ptr(), out_features,
                                       outs[name].data_ptr(), torch.get_num_threads()))
             for name, lib in builds.items()}
    best = dict.fromkeys(builds, float("inf"))
    for call, call_args in calls.values():
        call(*call_args)  # warm, and each build's output
    for _ in range(rounds):
        for name, (call, call_args) in calls.items():
            time.sleep(0.01)  # the other build's workers stop spinning first
            t0 = time.perf_counter()
            for _ in range(reps):
                call(*call_args)
            best[name] = min(best[name], (time.perf_counter() - t0) / reps)
    first = outs["this tree"]
    mb = weight.numel() * weight.element_size() / 1e6
    return {"rows": n, "ms": {k: v * 1e3 for k, v in best.items()},
            "gb_per_s": {k: mb / 1e3 / v for k, v in best.items()},
            "bitwise_equal": {k: bool(torch.equal(o, first)) for k, o in outs.items()}}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    names, dtypes, sizes = parse(args)
    reason = gemv.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"error: {reason}")
    builds = {"this tree": gemv.library()}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rev in args.against:
            builds[rev] = build_revision(rev, Path(tmp))
        for name in names:
            for dtype in dtypes:
                weight = torch.randn(*SHAPES[name], generator=torch.Generator().manual_seed(7)).to(dtype)
                for n in sizes:
                    row = {"weight": name, "shape": list(SHAPES[name]), "dtype": str(dtype).removeprefix("torch."),
                           **time_case(builds, weight, n, args.rounds, args.reps)}
                    results.append(row)
                    ms = row["ms"]
                    others = "".join(f"; {k} {v:.3f} ms ({v / ms['this tree']:.2f}x this tree's time)"
                                     for k, v in ms.items() if k != "this tree")
                    print(f"{name} {row['dtype']} {n:3d} rows: this tree {ms['this tree']:.3f} ms "
                          f"({row['gb_per_s']['this tree']:.1f} GB/s){others}", flush=True)
                    unequal = [k for k, same in row["bitwise_equal"].items() if not same]
                    if unequal:
                        print(f"  outputs differ from this tree's: {', '.join(unequal)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
