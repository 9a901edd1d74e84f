import json, subprocess, sys, time, types
from medusa import api
import medusa.serving.drafting as D
from medusa.serving.scheduler import Scheduler
old_src = subprocess.check_output(["git", "show", "HEAD:medusa/serving/drafting.py"], text=True)
old = types.ModuleType("old_drafting"); sys.modules["old_drafting"] = old
exec(compile(old_src, "old_drafting.py", "exec"), old.__dict__)
new_choose, old_choose = D.DraftPolicy.choose, old.DraftPolicy.choose
eng = api.load(autotune="cached")
tok = eng.tokenizer
rows = [json.loads(l) for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:16]
prompts = [tok.apply_chat_template(p.get("messages") or [{"role": "user", "content": p.get("prompt") or p.get("turns", [""])[0]}], add_generation_prompt=True) for p in rows]
levels = [int(x) for x in sys.argv[1].split(",")]
answers = {}
for rnd in range(int(sys.argv[2])):
    order = [("base", "baseline", new_choose), ("old", None, old_choose), ("new", None, new_choose)]
    if rnd % 2:
        order = order[::-1]
    for mb in levels:
        for name, mode, choose in order:
            D.DraftPolicy.choose = choose
            sched = Scheduler(eng, max_batch=mb).start()
            t0 = time.perf_counter()
            streams = [sched.submit(p, max_new_tokens=64, **({"mode": mode} if mode else {})) for p in prompts]
            outs = [s.wait().tokens for s in streams]
            dt = time.perf_counter() - t0
            sched.close(timeout=60)
            same = answers.setdefault(mb, outs) == outs
            print(json.dumps({"round": rnd, "c": mb, "name": name, "tps": round(sum(map(len, outs)) / dt, 2), "same": same}), flush=True)
