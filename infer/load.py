"""``python -m infer.load``: many users at once, this project's server beside the ones people
would deploy instead, measured the same way on the same prompts in one run.

    python -m infer.load --servers medusa,medusa-baseline,llama-server --concurrency 1,2,4,8 \\
        --prompts docs/benchmarks/prompts/heldout-serve.jsonl --max-tokens 128 --json load.json --plot load.png

Each server is started on 127.0.0.1, sent every prompt once per concurrency (streaming, greedy;
medusa/bench/loadgen.py), and stopped. ``medusa`` is ``python -m infer.serve`` in its default
mode, ``medusa-baseline`` the same server decoding without drafts (the engine's batched plain
decoding), ``llama-server`` llama.cpp's server with ``--parallel`` slots on the same weights as
an F32 GGUF (built once from PyPI's llama-cpp-python sources), ``vllm`` vLLM's CPU server with
``--max-num-seqs`` slots on the same weights in float32, ``vllm-ngram`` the same with vLLM's
prompt-lookup speculation (medusa/peers/vllm_server.py; the vLLM venv is created once), and
``url=URL`` an already running OpenAI-compatible server on this machine. Answers are compared across
concurrencies and servers: the table says how many match.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medusa.bench.loadgen import LoadResult, combine, interference, run_load, versus
from medusa.bench.servers import start, stop
from medusa.bench.soak import Soak
from medusa.errors import MedusaError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "docs" / "benchmarks" / "prompts" / "heldout-serve.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="medusa,medusa-baseline",
                   help="comma-separated: medusa, medusa-baseline, llama-server, vllm, vllm-ngram, url=URL "
                        "(default: medusa,medusa-baseline)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts (default: 1,2,4,8)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="jsonl with a `turns` list per line")
    p.add_argument("--limit", type=int, help="first N prompts only")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default: 128)")
    p.add_argument("--max-batch", type=int, default=8, help="our server's --max-batch, llama-server's --parallel and vLLM's --max-num-seqs")
    p.add_argument("--port", type=int, default=8391, help="port the started servers listen on (default: 8391)")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="the model id sent to url= servers")
    p.add_argument("--long-prompt", type=int, default=0, metavar="WORDS",
                   help="also send a prompt of about this many words while 3 streams run, and report their "
                        "inter-token latency before and during its prefill (0: skip)")
    p.add_argument("--soak", type=int, default=0, metavar="N",
                   help="instead of the concurrency levels, N mixed requests from 16 clients (greedy, sampled, stop, "
                        "logprobs, cancelled, malformed, oversized, bursts past a queue of 8): every answer checked "
                        "against the request alone, the server idle afterwards (medusa/bench/soak.py; 0: off)")
    p.add_argument("--split", action="store_true", help="first time this project's plain decoding step in process at 1 "
                   "and 8 sequences, split into linear layers, attention and the rest (the server's default engine)")
    p.add_argument("--rounds", type=int, default=1,
                   help="start every server at once and run each concurrency on each in turn, N times (the order "
                        "rotated each round), summing a server's rounds: a machine whose speed drifts then slows "
                        "every server alike (default: 1, the servers one after the other)")
    p.add_argument("--json", help="write every row (and the answers' agreement) here")
    p.add_argument("--plot", help="write a PNG of total tokens/s against concurrency here")
    return p


def row_line(server: str, result: LoadResult) -> str:
    return (f"{server:<16} c={result.concurrency:<2} {result.tokens_per_second:7.1f} tok/s  ttft p50 "
            f"{result.ttft_p50:.2f} s  itl p50/p95 {1e3 * result.itl_p50:.1f}/{1e3 * result.itl_p95:.1f} ms"
            + (f"  tau {result.tau:.2f}" if result.tau else ""))


def run_rounds(args: argparse.Namespace, prompts: list[str], levels: list[int], rows: list[dict], texts: dict) -> None:
    """``--rounds N``: every server started at once (each on its own port), then N rounds of every
    concurrency on every server in turn, the order rotated round by round; a server's row at a
    level sums its rounds (:func:`~medusa.bench.loadgen.combine`) and says in how many of its
    prompts every round gave the same answer."""
    names = args.servers.split(",")
    started, results = [], {}
    try:
        for i, server in enumerate(names):
            started.append(start(server, args.port + i, args.max_batch, args.model_name))
        for r in range(args.rounds):
            for c in levels:
                for k in range(len(names)):
                    j = (k + r) % len(names)
                    url, model, _ = started[j]
                    result = run_load(url, model, prompts, c, args.max_tokens)
                    results.setdefault((names[j], c), []).append(result)
                    print(f"round {r + 1}: " + row_line(names[j], result), flush=True)
    finally:
        for _, _, proc in started:
            if proc is not None:
                stop(proc)
    for server in names:
        for c in levels:
            runs = results[(server, c)]
            result = combine(runs)
            texts[(server, c)] = result.texts
            same = sum(all(run.texts[i] == result.texts[i] for run in runs) for i in range(len(prompts)))
            rows.append({"server": server, **result.row(), "rounds": len(runs), "same_every_round": same})
            print(row_line(server, result) + f"  ({len(runs)} rounds; the same answer every round: {same}/{len(prompts)})")


def read_prompts(path: str, limit: int | None) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        prompts = [json.loads(line)["turns"][0] for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, IndexError) as exc:
        raise MedusaError(f"cannot read prompts from {path} ({exc}): give a jsonl with a `turns` list per line") from None
    return prompts[:limit] if limit else prompts


def step_split_rows(prompts: list[str]) -> list[dict]:
    """The default engine's plain step at 1 and 8 sequences (medusa/bench/split.py), printed; the
    engine is let go before any server starts."""
    import gc

    import medusa
    from medusa.bench.prompts import encode
    from medusa.bench.split import split_lines, step_split

    engine = medusa.load()
    splits = step_split(engine, [encode(engine, p) for p in prompts[:8]])
    print("\n".join(split_lines(splits)), flush=True)
    del engine
    gc.collect()
    return [s.as_dict() for s in splits]


def long_text(words: int) -> str:
    """A long summarisation prompt of about ``words`` words (a document of varied sentences)."""
    sentences = ["The committee reviewed the annual report on regional water use.",
                 "Rainfall in the northern districts fell by a fifth compared with the previous year.",
                 "Farmers adopted drip irrigation on many of the larger plots.",
                 "City reservoirs stayed above their minimum levels through the summer.",
                 "Two treatment plants were upgraded and a third is being planned.",
                 "Household consumption dropped after the new tariffs took effect."]
    text, n = [], 0
    while n < words:
        s = sentences[len(text) % len(sentences)]
        text.append(s)
        n += len(s.split())
    return "Summarize the following report in three sentences.\n\n" + " ".join(text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prompts = read_prompts(args.prompts, args.limit)
        levels = [int(c) for c in args.concurrency.split(",")]
        rows, texts = [], {}
        if args.split:
            rows.append({"split": step_split_rows(prompts)})
        if args.rounds < 1 or (args.rounds > 1 and (args.soak or args.long_prompt)):
            raise MedusaError(f"--rounds {args.rounds}: use a positive count, and rounds with the concurrency "
                              "levels only (not --soak or --long-prompt)")
        if args.rounds > 1:
            run_rounds(args, prompts, levels, rows, texts)
        for server in args.servers.split(",") if args.rounds == 1 else ():
            url, model, proc = start(server, args.port, args.max_batch, args.model_name, 8 if args.soak else 256)
            try:
                if args.soak:
                    report = Soak(url, model, prompts, args.max_tokens, pid=proc.pid if proc else None).run(args.soak)
                    rows.append({"server": server, "soak": report.as_dict()})
                    print("\n".join(f"{server}: {text}" for text in report.lines()), flush=True)
                    continue
                for c in levels:
                    result = run_load(url, model, prompts, c, args.max_tokens)
                    texts[(server, c)] = result.texts
                    rows.append({"server": server, **result.row()})
                    print(row_line(server, result), flush=True)
                if args.long_prompt:
                    hit = interference(url, model, prompts, long_text(args.long_prompt), args.max_tokens)
                    rows.append({"server": server, "long_prompt_words": args.long_prompt, **hit})
                    print(f"{server:<16} a {args.long_prompt}-word prompt while 3 streams run: their itl p95 "
                          f"{1e3 * hit['steady_itl_p95']:.0f} -> {1e3 * hit['during_prefill_itl_p95']:.0f} ms "
                          f"({hit['ratio']:.1f}x) over its {hit['prefill_seconds']:.1f} s prefill", flush=True)
            finally:
                if proc is not None:
                    stop(proc)
    except MedusaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.soak:
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "prompts": args.prompts}, indent=1))
        return 0 if all(not row["soak"]["failures"] and row["soak"]["idle_after"] for row in rows if "soak" in row) else 1
    first = {s: texts[(s, levels[0])] for s, _ in texts}
    for row in rows:  # the same answers at every concurrency, and as the first server's
        if "concurrency" not in row:
            continue
        mine = texts[(row["server"], row["concurrency"])]
        row["same_as_c1"] = sum(a == b for a, b in zip(mine, first[row["server"]]))
        row["same_as_first_server"] = sum(a == b for a, b in zip(mine, next(iter(first.values()))))
        print(f"{row['server']:<16} c={row['concurrency']:<2} identical to its c={levels[0]}: "
              f"{row['same_as_c1']}/{len(mine)}, to {next(iter(first))}: {row['same_as_first_server']}/{len(mine)}")
    for line in versus(rows):
        print(line)
    if args.json:
        answers = {f"{server} c={c}": mine for (server, c), mine in texts.items()}
        Path(args.json).write_text(json.dumps({"rows": rows, "prompts": args.prompts, "max_tokens": args.max_tokens,
                                               "answers": answers}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in rows if "concurrency" in r]  # not the long-prompt rows
    for server in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == server]
        ax.plot([r["concurrency"] for r in mine], [r["tokens_per_second"] for r in mine], marker="o", label=server)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("total tokens/s")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
