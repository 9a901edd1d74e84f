"""Paired A/B of the lone check (medusa/decoding/payoff.py): per prompt, plain decoding, then each
mode with the check on and off back to back in one process (each heads kind's engine loaded once;
the order swapped every other round), ``reps`` rounds; decode seconds after the first token.

    python docs/benchmarks/2026-12-06-epyc-zen4-draft-check-paired.py PROMPTS LIMIT REPS OUT.json [MODES]
    HEADS=init python ...   # every mode on fresh heads instead of the shipped ones
"""
import dataclasses, json, os, sys
import medusa
from medusa.bench.prompts import encode, read_prompts

path, limit, reps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
modes = sys.argv[5].split(",") if len(sys.argv) > 5 else ["eagle", "eagle3", "medusa", "hybrid"]
first = medusa.load(heads=os.environ["HEADS"]) if "HEADS" in os.environ else medusa.load()
engines = {m: first if "HEADS" in os.environ or m == "hybrid" else medusa.load(heads=m) for m in modes}
engines["baseline"] = first
on = first.proposer_config
off = dataclasses.replace(on, check_drafting=False)
rows = []
for p in read_prompts(path, limit):
    ids = encode(first, p.text)
    for rep in range(reps):
        order = [("baseline", on)] + [(m, c) for m in modes for c in ((on, off) if rep % 2 == 0 else (off, on))]
        for mode, config in order:
            engine = engines[mode]
            engine.proposer_config = config
            res = engine.generate(ids, max_new_tokens=128, mode=mode)
            st = res.stats
            rows.append({"prompt": p.id, "category": p.category, "rep": rep, "mode": mode,
                         "check": config.check_drafting, "decode": st.seconds - st.prefill_seconds,
                         "whole": st.seconds, "steps": st.steps, "plain": st.plain_steps, "tokens": res.tokens})
        print(p.category, rep, flush=True)
json.dump(rows, open(out, "w"))
