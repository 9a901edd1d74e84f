import json, sys, time
from medusa import api
from medusa.serving.scheduler import Scheduler
eng = api.load(autotune="cached")
tok = eng.tokenizer
rows = [json.loads(l) for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:16]
prompts = [tok.apply_chat_template(p.get("messages") or [{"role": "user", "content": p.get("prompt") or p.get("turns", [""])[0]}], add_generation_prompt=True) for p in rows]
answers = {}
for rnd in range(3):
    for store in ((True, False) if rnd % 2 == 0 else (False, True)):
        for mb, mode in ((8, "baseline"), (8, None), (1, None)):
            sched = Scheduler(eng, max_batch=mb)
            if not store:
                eng.passes.store = None
            sched.start()
            t0 = time.perf_counter()
            streams = [sched.submit(p, max_new_tokens=64, **({"mode": mode} if mode else {})) for p in prompts]
            outs = [s.wait().tokens for s in streams]
            dt = time.perf_counter() - t0
            sched.close(timeout=60)
            eng.passes.store = None
            key = (mb, mode or "default")
            same = answers.setdefault(key, outs) == outs
            print(json.dumps({"round": rnd, "store": store, "max_batch": mb, "mode": mode or "default",
                              "tps": round(sum(map(len, outs)) / dt, 2), "same": same}), flush=True)
