"""Two checkouts of this repository side by side: the same modes on the same prompts, each in its
own process, the checkouts alternating round by round on one machine. Reports whether every
answer is token for token the same and each mode's tokens per second under each checkout (the
median over rounds): what a refactor of the loop must keep.

    python scripts/compare_revisions.py --old /tmp/old-checkout --new . --rounds 2 \\
        --json docs/benchmarks/DATE-MACHINE-compare.json

The prompts are MT-Bench's first turns and the held-out serving prompts
(docs/benchmarks/prompts/heldout-serve.jsonl), ``--limit`` of each, in the embedded model's chat
template; greedy; the default target and shipped heads (``medusa.load()``). Only the public API
is used, so any two revisions that have it compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# runs in a child process whose PYTHONPATH is one checkout; argv: prompts file, modes, max new tokens
WORKER = r"""
import json, sys, time
import torch
import medusa
prompts, modes, n = json.load(open(sys.argv[1])), sys.argv[2].split(","), int(sys.argv[3])
engine = medusa.load()
tok = engine.tokenizer
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                               return_dict=False) for p in prompts]
ids = [list(x["input_ids"] if isinstance(x, dict) else x) for x in ids]
engine.generate(ids[0], max_new_tokens=8)  # warm
out = {}
for mode in modes:
    tokens, seconds, new = [], 0.0, 0
    for p in ids:
        t0 = time.perf_counter()
        r = engine.generate(p, max_new_tokens=n, mode=mode)
        seconds += time.perf_counter() - t0
        tokens.append(r.tokens)
        new += len(r.tokens)
    out[mode] = {"tokens": tokens, "tokens_per_second": new / seconds}
print("RESULT " + json.dumps(out))
"""


def prompts(limit: int) -> list[str]:
    firsts = []
    for path in ("medusa/assets/mt_bench.jsonl", "docs/benchmarks/prompts/heldout-serve.jsonl"):
        lines = [line for line in (REPO / path).read_text().splitlines() if line.strip()]
        firsts += [json.loads(line)["turns"][0] for line in lines[:limit]]
    return firsts


def run(checkout: Path, prompt_file: Path, modes: str, max_new_tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", WORKER, str(prompt_file), modes, str(max_new_tokens)], cwd=checkout,
                          env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"error: the run under {checkout} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(line[len("RESULT "):])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/compare_revisions.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the earlier checkout (a git worktree)")
    p.add_argument("--new", default=str(REPO), help="the later checkout (default: this one)")
    p.add_argument("--modes", default="baseline,hybrid,eagle3,lookup")
    p.add_argument("--limit", type=int, default=10, help="prompts of each set (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write the summary here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    checkouts = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    for name, path in checkouts.items():
        if not (path / "medusa" / "__init__.py").is_file():
            p.error(f"--{name} {path} is not a checkout of this repository (no medusa/__init__.py)")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts(args.limit), f)
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
            results[name].append(run(checkouts[name], Path(f.name), args.modes, args.max_new_tokens))
    Path(f.name).unlink()
    summary = {}
    for mode in args.modes.split(","):
        runs = [x[mode] for name in ("old", "new") for x in results[name]]
        same = all(x["tokens"] == runs[0]["tokens"] for x in runs)
        old = statistics.median(x[mode]["tokens_per_second"] for x in results["old"])
        new = statistics.median(x[mode]["tokens_per_second"] for x in results["new"])
        rounds = {name: [round(x[mode]["tokens_per_second"], 2) for x in results[name]] for name in ("old", "new")}
        summary[mode] = {"identical": same, "old_tokens_per_second": round(old, 2),
                         "new_tokens_per_second": round(new, 2), "new_over_old": round(new / old, 3), "rounds": rounds}
        print(f"{mode:10s} identical {'yes' if same else 'NO'}  old {old:6.2f} tok/s  new {new:6.2f} tok/s  "
              f"new/old {new / old:.3f}  (rounds: old {rounds['old']}, new {rounds['new']})")
    if args.json:
        meta = {"old": str(checkouts["old"]), "new": str(checkouts["new"]), "modes": args.modes,
                "prompts": 2 * args.limit, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds}
        Path(args.json).write_text(json.dumps({"meta": meta, "modes": summary}, indent=1) + "\n")
    return 0 if all(s["identical"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
