"""Time a model's linear layers alone with each linear kernel, by rows per product.

    python scripts/bench_linears.py [--model M] [--rows 1,2,4,8,12,16,32,64] [--rounds 9] [--json OUT]

Every linear layer of the target as one pass runs it (q/k/v and gate/up stacked into one
product each, as the packed kernels run them; the vocabulary projection included), called
back to back with random float32 rows: torch's default kernel (``F.linear``: MKL), packed
oneDNN and the gemv kernels (medusa/runtime/gemv.py), interleaved round by round (a shared
machine's speed drifts), median per kernel. GB/s is the weights' bytes over the time: a few-row
product reads every weight once, so the machine's read bandwidth bounds it. It also checks
that the gemv kernels give each row of an n-row product bitwise its one-row product.
docs/performance.md#gemv-kernels shows a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from medusa.config import HelpFormatter, count
from medusa.models.target import load_target
from medusa.runtime import gemv
from medusa.runtime.kernels import linear_layers, onednn_available, pack, packed_product, sibling_groups


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/bench_linears.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", default="1,2,4,8,12,16,32,64", help="rows per product, comma-separated")
    ap.add_argument("--rounds", type=count(3), default=9, help="timed rounds per kernel and row count")
    ap.add_argument("--json", default=None, help="also write the results as JSON here (default: printed only)")
    return ap


def weights(model) -> list[torch.Tensor]:
    """The pass's products' weights: sibling layers stacked, every other linear layer alone."""
    layers = linear_layers([model], "gemv")
    groups = sibling_groups([model], layers)
    grouped = {id(layer) for group in groups for layer in group}
    out = [torch.cat([layer.weight.detach() for layer in group]) for group in groups]
    return out + [layer.weight.detach() for layer in layers if id(layer) not in grouped]


def kernels(ws: list[torch.Tensor]) -> dict:
    """Per kernel: ``run(inputs by in_features)``, one call per weight."""
    out = {"default": lambda xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws]}
    if onednn_available():
        packed = [pack(w) for w in ws]
        out["onednn"] = lambda xs: [packed_product(xs[w.shape[1]], p, w, None) for w, p in zip(ws, packed)]
    if gemv.available():
        packed_g = [gemv.pack(w) for w in ws]
        out["gemv"] = lambda xs: [gemv.product(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, packed_g)]
    return out


def row_invariant(ws: list[torch.Tensor], rows: int) -> bool:
    """Each row of a ``rows``-row gemv product equals its one-row product, bit for bit."""
    w = max(ws, key=lambda t: t.numel())
    p, x = gemv.pack(w), torch.randn(rows, w.shape[1])
    many = gemv.product(x, p, w.shape[0])
    return all(torch.equal(many[i], gemv.product(x[i:i + 1], p, w.shape[0])[0]) for i in range(rows))


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model, _ = load_target(args.model, device="cpu", dtype="float32")
    ws = weights(model)
    nbytes = sum(w.numel() * 4 for w in ws)
    runs = kernels(ws)
    result = {"threads": torch.get_num_threads(), "products": len(ws), "weight_bytes": nbytes, "rows": {}}
    print(f"{len(ws)} products, {nbytes / 1e6:.0f} MB of float32 weights, {torch.get_num_threads()} threads")
    print("| rows | " + " | ".join(f"{k} ms (GB/s)" for k in runs) + " | gemv rows bitwise one-row |")
    print("|---" * (len(runs) + 2) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in ws}}
        times = {k: [] for k in runs}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, run in runs.items():
                t0 = time.perf_counter()
                run(xs)
                times[name].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        invariant = row_invariant(ws, rows) if "gemv" in runs else None
        result["rows"][rows] = {"ms": ms, "gemv_row_invariant": invariant}
        cells = " | ".join(f"{ms[k]:.1f} ({nbytes / ms[k] / 1e6:.1f})" for k in runs)
        print(f"| {rows} | {cells} | {invariant} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
