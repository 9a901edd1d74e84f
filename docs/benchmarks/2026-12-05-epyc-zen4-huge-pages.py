import ctypes, json, os, sys, time
import torch
from medusa import api
from medusa.autotune.timing import measure_cost
eng = api.load(autotune="cached")
tok = eng.tokenizer
rows = [json.loads(l) for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:8]
prompts = [tok.apply_chat_template(p.get("messages") or [{"role": "user", "content": p.get("prompt") or p.get("turns", [""])[0]}], add_generation_prompt=True) for p in rows]
def huge():
    return next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
out = {"which": os.environ.get("MEDUSA_HUGE_PAGES", "1"), "anon_huge_kb": huge()}
for mode in ("baseline", "eagle3", "hybrid"):
    n = 0; v = 0.0; steps = 0; t0 = time.perf_counter()
    for p in prompts:
        r = eng.generate(p, max_new_tokens=64, mode=mode)
        n += len(r.tokens); v += r.stats.verify_seconds; steps += r.stats.steps
    out[mode] = round(n / (time.perf_counter() - t0), 2)
    out[mode + "_verify_ms"] = round(1e3 * v / steps, 2)
with eng.kernel_scope():
    c = measure_cost(eng.model, [1, 6, 11], prefix=256, reps=7)
out["T"] = {k: round(v, 2) for k, v in c.items()}
print(json.dumps(out), flush=True)
