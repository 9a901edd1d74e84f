"""The vocabulary screen on and off in one process, each prompt through every variant in turn,
the order rotated by prompt and round (docs/benchmarks/2026-12-06-epyc-zen4-vocab-screen.md).

    python docs/benchmarks/2026-12-06-epyc-zen4-vocab-screen-ab.py --limit 16 --rounds 3 \
        --modes baseline,hybrid,eagle3 --json runs/screen-ab.jsonl

Prints tokens/s summed per mode and variant, and whether every answer was the same both ways."""

from __future__ import annotations

import argparse
import json
import time

import medusa

p = argparse.ArgumentParser()
p.add_argument("--prompts", default="docs/benchmarks/prompts/heldout-serve.jsonl")
p.add_argument("--limit", type=int, default=16)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--max-new-tokens", type=int, default=64)
p.add_argument("--modes", default="baseline,hybrid,eagle3")
p.add_argument("--json", default=None)
args = p.parse_args()

eng = medusa.load()
screen = eng.passes.screen
assert screen is not None, "the screen does not apply on this machine's plan"
print("\n".join(eng.describe()))
texts = [json.loads(line)["turns"][0] for line in open(args.prompts)][: args.limit]
prompts = []
for text in texts:
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
modes = args.modes.split(",")
variants = [(mode, on) for mode in modes for on in (False, True)]
seconds = {v: 0.0 for v in variants}
tokens = {v: 0 for v in variants}
answers: dict[tuple, list] = {}
out = open(args.json, "w") if args.json else None
for r in range(args.rounds):
    for i, ids in enumerate(prompts):
        k = (i + r) % len(variants)
        for mode, on in variants[k:] + variants[:k]:
            eng.passes.screen = screen if on else None
            t0 = time.perf_counter()
            got = eng.generate(ids, max_new_tokens=args.max_new_tokens, mode=mode)
            dt = time.perf_counter() - t0
            seconds[(mode, on)] += dt
            tokens[(mode, on)] += len(got.tokens)
            answers.setdefault((mode, i), []).append(got.tokens)
            if out:
                out.write(json.dumps({"round": r, "prompt": i, "mode": mode, "screen": on, "seconds": dt,
                                      "tokens": len(got.tokens), "steps": got.stats.steps}) + "\n")
    for mode in modes:
        off, on = (tokens[(mode, s)] / seconds[(mode, s)] for s in (False, True))
        print(f"after round {r + 1}: {mode:10s} off {off:6.1f} on {on:6.1f} tokens/s  on/off {on / off:.3f}", flush=True)
same = all(all(a == v[0] for a in v) for v in answers.values())
print(f"every answer the same with and without the screen, in every round: {same}")
