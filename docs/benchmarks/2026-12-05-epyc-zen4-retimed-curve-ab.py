"""Library A/B in one process: trees sized from the plan's curve before a load timed it again (argv[1]: that
plan.json, copied first) and from the curve now cached."""
import dataclasses, json, sys, time, copy
from medusa import api
from medusa.autotune.sizing import sizable, sizes_from, SIZES, PREFIX
from medusa.autotune.timing import measure_cost
from medusa.autotune.planner import Planner
eng = api.load(autotune="cached")
tok = eng.tokenizer
rows = [json.loads(l) for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:16]
prompts = [tok.apply_chat_template(p.get("messages") or [{"role": "user", "content": p.get("prompt") or p.get("turns", [""])[0]}], add_generation_prompt=True) for p in rows]
import json as J
d = J.load(open("/root/.cache/medusa/plan.json"))["entries"]
entry = next(v for k, v in d.items() if k.startswith("sizes") and "gemv-p9" in k and "eagle3" in k)
curves = sizable(eng.heads, eng.device, eng.model.dtype, False)
old = J.load(open(sys.argv[1]))["entries"]
slow = next(v for k, v in old.items() if k.startswith("sizes") and "gemv-p9" in k and "eagle3" in k)
fresh = dict(entry); cached = dict(slow)
print("T1", fresh["cost_ms"]["1"], cached["cost_ms"]["1"])
a = sizes_from(cached, curves, None, False); b = sizes_from(fresh, curves, None, False)
print("cached:", a.reason[:300], flush=True)
print("fresh: ", b.reason[:300], flush=True)
plans = {"cached": dataclasses.replace(eng.plan, eagle=a.eagle, hybrid=a.hybrid),
         "fresh": dataclasses.replace(eng.plan, eagle=b.eagle, hybrid=b.hybrid)}
for rnd in range(3):
    order = ["cached", "fresh"] if rnd % 2 == 0 else ["fresh", "cached"]
    for name in order:
        eng.plan = plans[name]
        for mode in ("hybrid", "eagle3"):
            n = 0; t0 = time.perf_counter()
            for p in prompts:
                n += len(eng.generate(p, max_new_tokens=64, mode=mode).tokens)
            print(json.dumps({"round": rnd, "plan": name, "mode": mode, "tps": round(n / (time.perf_counter() - t0), 2)}), flush=True)
    eng.plan = plans["cached"]
    n = 0; t0 = time.perf_counter()
    for p in prompts:
        n += len(eng.generate(p, max_new_tokens=64, mode="baseline").tokens)
    print(json.dumps({"round": rnd, "plan": "-", "mode": "baseline", "tps": round(n / (time.perf_counter() - t0), 2)}), flush=True)
