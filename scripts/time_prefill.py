"""How long does a prompt's prefill take with each linear kernel? One uncached pass over the
first N tokens of a fixed token sequence, per length and kernel, timed round-robin.

A long prompt's answer is mostly its prefill (docs/benchmarks/2026-12-05-epyc-zen4-long-context-one-call.md):
this says whether another kernel would shorten it. GFLOP/s counts the linear layers' two flops per
weight per token (the attention's are left out, so they show as a falling rate at long lengths).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import medusa
from medusa.config import HelpFormatter, count
from medusa.runtime import hf as kv
from medusa.runtime.kernels import PackedLinears


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/time_prefill.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--lengths", default="256,1024,2048", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--kernels", default="gemv,onednn,default",
                    help="linear kernels to compare, comma-separated (gemv, onednn, default: torch's own)")
    ap.add_argument("--rounds", type=count(), default=2, help="timed rounds (the median is reported)")
    ap.add_argument("--json", default=None, help="also write the results as JSON here (default: printed only)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths takes token counts separated by commas, not {args.lengths!r}") from None
    if any(n < 1 for n in lengths):
        raise SystemExit("--lengths: every length must be at least 1 token")
    kinds = args.kernels.split(",")
    if not set(kinds) <= {"gemv", "onednn", "default"}:
        raise SystemExit(f"--kernels takes gemv, onednn and default, not {args.kernels!r}")
    engine = medusa.load(args.model, autotune="cached")
    model = engine.model
    scopes = {k: (contextlib.nullcontext() if k == "default" else PackedLinears(model, kernels=k))
              for k in kinds}
    weights = sum(p.numel() for name, p in model.named_parameters() if "layers." in name and p.dim() == 2)
    ids = torch.randint(100, model.config.vocab_size - 1, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in lengths} for k in scopes}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for kernels, scope in scopes.items():
                for n in lengths:
                    with scope:
                        cache, t0 = kv.new_cache(), time.perf_counter()
                        kv.forward(model, ids[:, :n], torch.arange(n)[None], cache, None, logits_rows=slice(-1, None))
                        times[kernels][n].append(time.perf_counter() - t0)
    rows = []
    for kernels, by_n in times.items():
        for n, samples in by_n.items():
            s = statistics.median(samples)
            rows.append({"kernels": kernels, "tokens": n, "ms": 1e3 * s, "tokens_per_s": n / s,
                         "linear_gflops": 2 * weights * n / s / 1e9})
            print(f"{kernels:>8} {n:>6} tokens: {1e3 * s:8.0f} ms  {n / s:6.0f} tokens/s  "
                  f"linears {2 * weights * n / s / 1e9:5.0f} GFLOP/s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"lengths": lengths, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
