"""Greedy chains of a batch accepted at once (one host sync: medusa/decoding/run.py accept_chains)
or one by one (accept), alternating in one process: 8 held-out prompts decoded side by side in
plain decoding, 30 steps timed after 3, eight rounds; the tokens must agree.

    python docs/benchmarks/2026-12-06-epyc-zen4-prefix-cache-chains-ab.py
"""
import json, time, sys
import medusa
import medusa.decoding.batch as batchmod
from medusa.decoding.batch import Batch
from medusa.decoding.request import make_request
on = batchmod._accepted_chains
off = lambda live, proposals, verified: verified
engine = medusa.load(); tok = engine.tokenizer
prompts = [json.loads(l)["turns"][0] for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:8]
ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False)) for p in prompts]
res = {"on": [], "off": []}
toks = {}
with engine.owned():
    for rnd in range(8):
        for name in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            batchmod._accepted_chains = on if name == "on" else off
            batch = Batch(engine.passes, engine.max_rows)
            runs = [engine.decoding(make_request(x, max_new_tokens=48, mode="baseline", ignore_eos=True)) for x in ids]
            for r in runs: batch.add(r)
            while batch.prefilling: batch.prefill()
            for _ in range(3): batch.step()
            t0 = time.perf_counter()
            for _ in range(30): batch.step()
            res[name].append(1000 * (time.perf_counter() - t0) / 30)
            toks.setdefault(name, [r.emitted for r in runs])
assert toks["on"] == toks["off"]
for k, v in res.items(): print(k, " ".join("%.2f" % x for x in v), "mean %.2f" % (sum(v) / len(v)))
