import json, sys, time, dataclasses
import torch
from medusa import api
from medusa.autotune.drawn import drawn_table, drawn_records, describe_drawn
eng = api.load(autotune="cached")
tok = eng.tokenizer
rows = [json.loads(l) for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")]
prompts = [tok.apply_chat_template(p.get("messages") or [{"role": "user", "content": p.get("prompt") or p.get("turns", [""])[0]}], add_generation_prompt=True) for p in rows]
new = eng.plan
records = drawn_records(eng.heads, eng.device, eng.model.dtype)
stripped = {t: {k: v for k, v in r.items() if k != "wide"} for t, r in records.items()}
old = dataclasses.replace(new, drawn=drawn_table(stripped, dict(new.pass_ms)))
print("new:", describe_drawn(new.drawn), flush=True)
print("old:", describe_drawn(old.drawn), flush=True)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
def run(mode, plan, temp):
    eng.plan = plan
    n = steps = 0; t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        r = eng.generate(p, max_new_tokens=128, mode=mode, temperature=temp, seed=i)
        n += len(r.tokens); steps += r.stats.steps
    return n / (time.perf_counter() - t0), n / max(steps, 1)
for temp in (0.7, 1.0):
    for rnd in range(rounds):
        for name, mode, plan in (("baseline", "baseline", new), ("hybrid-chain", "hybrid", old), ("hybrid-width", "hybrid", new), ("eagle3-chain", "eagle3", old), ("eagle3-width", "eagle3", new)):
            tps, tau = run(mode, plan, temp)
            print(json.dumps({"T": temp, "round": rnd, "name": name, "tps": round(tps, 2), "tau": round(tau, 3)}), flush=True)
