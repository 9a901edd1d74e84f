"""The scheduler's loop on the process's initial thread (as python -m infer.serve runs it) against
a thread of its own (Scheduler.start), one process per run, runs alternating:

    for i in 1 2 3; do for c in 1 8; do for w in main thread; do python THIS $w $c; done; done; done

Each run: the embedded model and its shipped heads, the default mode, 16 held-out prompts x 64
tokens, greedy, ``c`` requests at a time (after one warm-up request). Prints one JSON line."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
import threading
import time

import medusa
from medusa.serving.scheduler import Scheduler

where, concurrency = sys.argv[1], int(sys.argv[2])  # "main" or "thread", requests at a time
prompts = [json.loads(line)["turns"][0] for line in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:16]
engine = medusa.load()
tok = engine.tokenizer
ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False)) for p in prompts]
sched = Scheduler(engine, max_batch=8)
out = {}


def client() -> None:
    sched.submit(ids[0], max_new_tokens=64).wait()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out["results"] = list(pool.map(lambda x: sched.submit(x, max_new_tokens=64).wait(), ids))
    out["seconds"] = time.perf_counter() - t0
    threading.Thread(target=sched.close).start()


if where == "main":
    threading.Thread(target=client).start()
    sched.run()
else:
    sched.start()
    client()
    sched.close()
rs = out["results"]
steps = sum(r.stats.steps for r in rs)
print(json.dumps({"where": where, "concurrency": concurrency, "tokens_per_s": round(sum(len(r.tokens) for r in rs) / out["seconds"], 1),
                  "verify_ms_per_step": round(1000 * sum(r.stats.verify_seconds for r in rs) / steps, 2),
                  "steps": steps, "tokens": [r.tokens for r in rs]}))
