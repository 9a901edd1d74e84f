"""Where does one target pass go? Time per op class against this machine's memory bandwidth.

    python scripts/profile_pass.py [--model M] [--rows 1,16] [--prefix 200] [--reps 30] [--json OUT]
    python scripts/profile_pass.py --prefix 256,1024,2048,4096,8192 --rows 1,8,16 --no-engine   # by context
    python scripts/profile_pass.py ... --attention model   # the model's own masked attention instead

For each pass size (a one-token pass is plain decoding's whole step; 16 rows a tree), the pass
runs the way the engine runs it eagerly (the machine plan's dtype and linear kernels, its KV
cache after a ``--prefix``-token prompt) and reports:

- the wall time of the pass without the profiler (median of ``--reps``);
- torch.profiler's self time per op class in profiled passes (slower by the profiler's cost
  per op): the vocabulary projection, the other linear layers, attention, the KV cache's
  writes, norms/rotary/elementwise ops; "Python and dispatch" is the profiled wall time no
  op accounts for;
- the bytes each class must read at least (weights; the cache for attention) and the GB/s
  that implies, beside the copy and read bandwidth measured here on a buffer larger than the
  caches.

With several ``--prefix`` values (comma-separated) each is profiled on its own cache and a last
table gives the pass's wall time per context length and row count, and what a row beyond the
first costs there (docs/performance.md#a-pass-at-long-context).

Then (unless ``--no-engine``) the engine's plain decoding itself (``mode="baseline"``: ms per token over a generation),
eager and, with ``--compiled``, with compiled passes (``compile=True``; compiling takes minutes
the first time). docs/performance.md#where-a-pass-goes shows a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

import medusa
from medusa.config import HelpFormatter, count
from medusa.decoding.passes.strategies import kernel_scope
from medusa.runtime import hf as kv
from medusa.runtime import packed
from medusa.runtime import rows as rows_kernel
from medusa.runtime.kernels import kernels_arg
from medusa.serving.scheduler import kv_bytes_per_token

CLASSES = ("vocabulary projection", "linear layers", "attention", "KV cache writes", "norms, rotary, elementwise",
           "Python and dispatch")
ATTENTION_OPS = ("scaled_dot_product", "softmax", "bmm", "baddbmm", "flash_attention")
LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "_linear_pointwise", "mkldnn_linear",
              "medusa::gemv")  # the gemv kernels' events are named "medusa::gemv ROWSxIN->OUT"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/profile_pass.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--kernels", default=None, type=kernels_arg,
                    help="linear kernels (default: the machine plan's pick)")
    ap.add_argument("--rows", default="1,16", help="pass sizes to profile, comma-separated")
    ap.add_argument("--prefix", type=_counts, default=[200],
                    help="cached tokens before the pass; several, comma-separated, give the table by context length")
    ap.add_argument("--reps", type=count(3), default=30, help="timed passes per size")
    ap.add_argument("--new-tokens", type=count(8), default=64, help="tokens per generation for the engine rows")
    ap.add_argument("--compiled", action="store_true", help="also time plain decoding with compiled passes")
    ap.add_argument("--no-engine", action="store_true", help="skip timing the engine's plain decoding")
    ap.add_argument("--attention", choices=("engine", "model"), default="engine",
                    help="engine: the passes' attention as the engine runs it (one call per layer for every row in "
                         "float32 on a CPU, medusa/runtime/rows.py); model: the model's own masked attention")
    ap.add_argument("--json", default=None, help="also write the results as JSON here (default: printed only)")
    return ap


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def bandwidth(megabytes: int = 512, reps: int = 5) -> dict[str, float]:
    """GB/s of a copy (bytes read + written) and of a read (a sum) over a buffer far larger than
    the CPU caches: the rate a pass that streams its weights once could reach at best."""
    src = torch.rand(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    copy = min(_seconds(lambda: dst.copy_(src)) for _ in range(reps))
    read = min(_seconds(lambda: src.sum()) for _ in range(reps))
    size = src.numel() * 4
    return {"copy_gbs": 2 * size / copy / 1e9, "read_gbs": size / read / 1e9}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the vocabulary projection and of every other linear layer's weights."""
    head = model.get_output_embeddings().weight
    linear = sum(m.weight.numel() * m.weight.element_size() for m in model.get_decoder().modules()
                 if isinstance(m, torch.nn.Linear))
    return {"vocabulary projection": head.numel() * head.element_size(), "linear layers": linear}


def classify(name: str, shapes: list, vocab: int) -> str:
    """The op class of one profiler event (its op name and input shapes)."""
    if any(a in name for a in ATTENTION_OPS):
        return "attention"
    if any(name.endswith(op) or op in name for op in LINEAR_OPS):
        flat = [d for s in shapes if isinstance(s, list) for d in s]
        return "vocabulary projection" if vocab in flat or name.endswith(f"->{vocab}") else "linear layers"
    four_d = [s for s in shapes if isinstance(s, list) and len(s) == 4]
    if name in ("aten::copy_", "aten::index_copy_", "aten::slice_scatter") and four_d:
        return "KV cache writes"
    return "norms, rotary, elementwise"


def one_pass(model, cache, prefix: int, rows: int, one_call: bool = False):
    """A pass of ``rows`` new tokens after ``prefix`` cached ones (a chain: causal mask), then
    the cache cut back, as the engine does after verification. ``one_call``: attention as the
    engine runs it in float32 on a CPU (one call per layer, medusa/runtime/rows.py)."""
    ids = torch.randint(100, 10000, (1, rows))
    positions = torch.arange(prefix, prefix + rows)[None]
    if one_call:
        chain = torch.ones(rows, rows, dtype=torch.bool).tril_()
        layout = rows_kernel.layout_for(model, [(prefix, chain, torch.arange(rows))])

        def run_one_call():
            segment = packed.Segment(cache, slice(0, rows), None)
            packed.forward(model, ids, positions, [segment], layout=layout, starts=[prefix])
            kv.crop(cache, prefix)
        return run_one_call
    mask = None if rows == 1 else kv.causal_mask(model, prefix, rows, model.dtype, ids.device)

    def run():
        kv.forward(model, ids, positions, cache, mask)
        kv.crop(cache, prefix)
    return run


def profile_size(model, cache, prefix: int, rows: int, reps: int, one_call: bool = False) -> dict:
    """Wall time and the profiler's self time per class for passes of ``rows`` rows (the one-call
    attention is a C call, not a torch op: the profiler counts it as Python and dispatch)."""
    run = one_pass(model, cache, prefix, rows, one_call)
    for _ in range(3):
        run()
    wall = statistics.median(_seconds(run) for _ in range(reps))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        profiled = statistics.median(_seconds(run) for _ in range(reps))
    vocab = model.get_output_embeddings().weight.shape[0]
    per_class: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        per_class[classify(event.key, event.input_shapes, vocab)] += event.self_cpu_time_total / 1e6 / reps
    # the profiled passes are slower (the profiler's cost per op): shares are of their wall time
    per_class["Python and dispatch"] = max(0.0, profiled - sum(per_class.values()))
    return {"rows": rows, "wall_ms": wall * 1e3, "profiled_ms": profiled * 1e3,
            "ms": {c: per_class.get(c, 0.0) * 1e3 for c in CLASSES}}


def kv_bytes(model, prefix: int) -> int:
    """Bytes of keys and values attention reads over ``prefix`` cached tokens."""
    return prefix * kv_bytes_per_token(model)


def engine_ms_per_token(engine, new_tokens: int, reps: int = 3) -> float:
    """Plain decoding's ms per token over a generation (the best of ``reps``)."""
    text = "Explain how a bicycle's gears change the effort needed to climb a hill."
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
    engine.generate(prompt, max_new_tokens=8, mode="baseline")
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=new_tokens, mode="baseline")
        best = min(best, (time.perf_counter() - t0) / max(1, out.stats.new_tokens))
    return best * 1e3


def table(result: dict) -> str:
    """A markdown table: ms and GB/s per op class, one column pair per pass size."""
    sizes = result["passes"]
    head = "| op class | " + " | ".join(f"{p['rows']} row(s): ms | share | GB/s" for p in sizes) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(sizes)]
    for c in CLASSES:
        cells = []
        for p in sizes:
            ms, moved = p["ms"][c], result["bytes"].get(c)
            rate = f"{moved / ms / 1e6:.1f}" if moved and ms > 0 else ""
            cells.append(f"{ms:.2f} | {ms / p['profiled_ms']:.0%} | {rate}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("| pass, profiled | " + " | ".join(f"{p['profiled_ms']:.2f} | 100% | " for p in sizes) + " |")
    lines.append("| **pass, not profiled** | " + " | ".join(f"**{p['wall_ms']:.2f}** | | " for p in sizes) + " |")
    return "\n".join(lines)


def context_table(result: dict) -> str:
    """A markdown table: the pass's wall time per context length (rows) and pass size (columns),
    the attention share of the profiled pass, and the cost of each row beyond the first."""
    by = result["by_prefix"]
    sizes = [p["rows"] for p in by[0]["passes"]]
    head = "| cached tokens | " + " | ".join(f"{n} row(s) ms (attention)" for n in sizes)
    extra = [n for n in sizes if n > 1]
    head += "".join(f" | ms per extra row at {n}" for n in extra) + " |"
    lines = [head, "|---|" + "---|" * (len(sizes) + len(extra))]
    for entry in by:
        passes = {p["rows"]: p for p in entry["passes"]}
        cells = [f"{p['wall_ms']:.2f} ({p['ms']['attention'] / p['profiled_ms']:.0%})" for p in entry["passes"]]
        one = passes.get(1)
        cells += [f"{(passes[n]['wall_ms'] - one['wall_ms']) / (n - 1):.2f}" if one else "" for n in extra]
        lines.append(f"| {entry['prefix']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = medusa.load(model=args.model, kernels=args.kernels)
    model = engine.model
    result = {"machine": {"threads": torch.get_num_threads(), "dtype": str(model.dtype), "torch": torch.__version__,
                          "plan": engine.describe()},
              "bandwidth": bandwidth(), "by_prefix": []}
    longest = kv.text_config(model).max_position_embeddings
    if max(args.prefix) + max(int(r) for r in args.rows.split(",")) > longest:
        raise SystemExit(f"--prefix {max(args.prefix)} plus the rows is past the model's {longest} positions: "
                         "give shorter prefixes")
    one_call = args.attention == "engine" and engine.passes.one_call
    result["machine"]["attention"] = "one call per layer" if one_call else "the model's"
    with torch.inference_mode(), kernel_scope(model, engine.plan.kernels):
        for prefix in args.prefix:
            cache = kv.new_cache()
            kv.forward(model, torch.randint(100, 10000, (1, prefix)), torch.arange(prefix)[None], cache, None,
                       logits_rows=slice(-1, None))
            passes = [profile_size(model, cache, prefix, int(r), args.reps, one_call) for r in args.rows.split(",")]
            result["by_prefix"].append({"prefix": prefix, "passes": passes,
                                        "bytes": {**weight_bytes(model), "attention": kv_bytes(model, prefix)}})
            del cache
    first = result["by_prefix"][0]
    result.update(passes=first["passes"], bytes=first["bytes"])  # the first prefix's op table
    result["engine_ms_per_token"] = {} if args.no_engine else {"eager": engine_ms_per_token(engine, args.new_tokens)}
    if args.compiled:
        compiled = medusa.load(model=args.model, kernels=args.kernels, compile=True)
        result["engine_ms_per_token"]["compiled"] = engine_ms_per_token(compiled, args.new_tokens)
    bw = result["bandwidth"]
    print(f"{model.dtype}, {torch.get_num_threads()} threads; copy {bw['copy_gbs']:.1f} GB/s, read {bw['read_gbs']:.1f} GB/s")
    for entry in result["by_prefix"]:
        print(f"\n{entry['prefix']} cached tokens:")
        print(table({"passes": entry["passes"], "bytes": entry["bytes"]}))
    if len(result["by_prefix"]) > 1:
        print("\nby context length (wall ms, not profiled):")
        print(context_table(result))
    weights = sum(v for k, v in result["bytes"].items() if k != "attention")
    for name, ms in result["engine_ms_per_token"].items():
        print(f"plain decoding ({name}): {ms:.2f} ms/token = {weights / ms / 1e6:.1f} GB/s of weights")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
