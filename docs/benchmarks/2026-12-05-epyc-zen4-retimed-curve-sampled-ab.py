"""Sampled A/B in one process: drawn sizes from the slow-state curve vs the re-timed one, T=0.7 and 1."""
import dataclasses, json, sys, time
from medusa import api
from medusa.autotune.drawn import drawn_table, drawn_records
from medusa.autotune.sizing import cost_at, PREFIX
eng = api.load(autotune="cached")
tok = eng.tokenizer
rows = [json.loads(l) for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:16]
prompts = [tok.apply_chat_template(p.get("messages") or [{"role": "user", "content": p.get("prompt") or p.get("turns", [""])[0]}], add_generation_prompt=True) for p in rows]
old = json.load(open(sys.argv[1]))["entries"]
slow = next(v for k, v in old.items() if k.startswith("sizes") and "gemv-p9" in k and "eagle3" in k)
plans = {"retimed": eng.plan,
         "slow": dataclasses.replace(eng.plan, drawn=drawn_table(drawn_records(eng.heads, eng.device, eng.model.dtype),
                                                                   cost_at(slow, PREFIX)))}
for name, plan in plans.items():
    print(name, plan.drawn, flush=True)
for rnd in range(3):
    for T in (0.7, 1.0):
        order = ["slow", "retimed"] if rnd % 2 == 0 else ["retimed", "slow"]
        for name in order + ["-"]:
            eng.plan = plans.get(name, plans["retimed"])
            for mode in (("hybrid", "eagle3") if name != "-" else ("baseline",)):
                n = 0; t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    n += len(eng.generate(p, max_new_tokens=64, mode=mode, temperature=T, seed=i).tokens)
                print(json.dumps({"round": rnd, "T": T, "plan": name, "mode": mode, "tps": round(n / (time.perf_counter() - t0), 2)}), flush=True)
