"""A prompt past a shared prefix by a few tokens (here: the whole prompt cached, one token left)
run in the decoding step's pass (FUSED_ROWS 8) or in a pass of its own (0), alternating, in one
process: the embedded model, the default mode, 16 held-out prompts x 64 tokens, c requests at a
time through the scheduler (no HTTP), after each prompt was answered once. Prints JSON lines.

    python docs/benchmarks/2026-12-06-epyc-zen4-prefix-cache-fuse-ab.py
"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import medusa
import medusa.serving.scheduler as scheduling
from medusa.serving.scheduler import Scheduler
prompts = [json.loads(l)["turns"][0] for l in open("docs/benchmarks/prompts/heldout-serve.jsonl")][:16]
engine = medusa.load(); tok = engine.tokenizer
ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False)) for p in prompts]
sched = Scheduler(engine, max_batch=8).start()
with ThreadPoolExecutor(4) as pool:  # every prompt answered once: the prompt cache holds them all
    first = list(pool.map(lambda x: sched.submit(x, max_new_tokens=64).wait(), ids))
for c in (2, 4, 8):
    for rnd in range(4):
        for rows in ((8, 0) if rnd % 2 == 0 else (0, 8)):
            scheduling.FUSED_ROWS = rows
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                rs = list(pool.map(lambda x: sched.submit(x, max_new_tokens=64).wait(), ids))
            s = time.perf_counter() - t0
            assert [r.tokens for r in rs] == [r.tokens for r in first]
            print(json.dumps({"c": c, "fused_rows": rows, "tok_s": round(sum(len(r.tokens) for r in rs) / s, 1),
                              "prefill_tokens": sum(r.stats.prefill_tokens for r in rs)}), flush=True)
sched.close()
