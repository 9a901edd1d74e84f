"""A/B: hybrid as planned vs 'chain where the text repeats (>= N-gram match), else the heads' tree'."""
import json, sys, time
import torch
from medusa import api
from medusa.decoding.proposers.lookup import PromptLookup
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.state import Proposer

class Fallback(Proposer):
    def __init__(self, heads, lookup):
        self.heads, self.lookup = heads, lookup
        self.max_rows = max(heads.max_rows, lookup.max_rows); self.min_rows = 1
        self.chain_step = False
    def describe(self): return "fallback"
    def begin(self, state):
        self.heads.begin(state); self.lookup.begin(state)
    def propose(self, state):
        copied = self.lookup.propose(state)
        self.chain_step = copied.tokens.numel() > 1
        if self.chain_step:
            return copied
        return self.heads.propose(state)
    def update(self, state, outcome):
        h = self.heads
        if self.chain_step and h.active:  # fed when the head next drafts
            nodes = torch.tensor(outcome.nodes)
            h.pending.append((outcome.hidden[nodes], list(outcome.tokens), outcome.start))
        else:
            h.update(state, outcome)
        self.lookup.update(state, outcome)

eng = api.load(autotune="cached")
tok = eng.tokenizer
src = sys.argv[1]
rows = [json.loads(l) for l in open(src)]
rows = rows[::max(1, len(rows) // 16)][:16]
def text(p):
    return p.get("messages") or [{"role": "user", "content": p.get("prompt") or p.get("turns", [""])[0]}]
prompts = [tok.apply_chat_template(text(p), add_generation_prompt=True) for p in rows]
print(eng.plan.decision("trees").reason[:160], flush=True)
def fallback(min_n, k, size):
    heads = eng.proposer("eagle3")
    heads.size = size
    return Fallback(heads, PromptLookup(eng.device, num_tokens=k, max_ngram=3, min_ngram=min_n))
variants = {
    "hybrid": lambda: "hybrid",
    "eagle3": lambda: "eagle3",
    "fb2-k4-3n": lambda: fallback(2, 4, DynamicTree(nodes=3, depth=3, topk=2)),
    "baseline": lambda: "baseline",
}
names = list(variants)
tot = {n: [0, 0.0, 0] for n in names}
for rnd in range(2):
    for i, p in enumerate(prompts):
        k = (i + rnd) % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            r = eng.generate(p, max_new_tokens=64, mode=variants[name]())
            tot[name][1] += time.perf_counter() - t0; tot[name][0] += len(r.tokens); tot[name][2] += r.stats.steps
    print(json.dumps({"round": rnd, **{n: [round(v[0] / v[1], 2), round(v[0] / v[2], 3)] for n, v in tot.items()}}), flush=True)
