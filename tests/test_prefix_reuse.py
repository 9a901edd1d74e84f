"""A scheduled greedy prompt starts after the prefix it shares with a finished one
(medusa/serving/scheduler.py): copied, not prefilled, with the very bits and tokens its own
prefill gives, on a tiny real model and the gemv kernels built here."""

from __future__ import annotations

import torch
from tiny import hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.serving.scheduler import Scheduler, shares_prefixes


def test_a_prompt_sharing_a_finished_ones_prefix_starts_after_it_with_the_same_tokens():
    model = tiny_model("llama")
    heads = init_eagle3_for(model, 3)
    eng = Engine(model, heads=heads, plan=Plan(kernels="gemv"))
    assert shares_prefixes(eng)
    shared = list(range(10, 40))
    a, b = shared + [5, 6, 7], shared + [9, 8]
    sched = Scheduler(eng, max_batch=2).start()
    try:
        first = sched.submit(a, max_new_tokens=12, mode="baseline").wait()
        second = sched.submit(b, max_new_tokens=12, mode="hybrid").wait()
        again = sched.submit(b, max_new_tokens=12, mode="baseline").wait()
        sampled = sched.submit(b, max_new_tokens=12, mode="baseline", temperature=0.8, seed=1).wait()
    finally:
        sched.close(timeout=60)
    assert not sched._finished  # closing lets their caches go
    assert first.stats.prefill_tokens == len(a)
    assert second.stats.prefill_tokens == len(b) - len(shared)  # the shared 30 were copied
    assert again.stats.prefill_tokens == 1  # all of it but the last token, run for its logits
    assert sampled.stats.prefill_tokens == len(b)  # sampled requests prefill whole
    assert sched.reused_tokens == len(shared) + len(b) - 1
    alone = Engine(model, heads=heads, plan=Plan(kernels="gemv"))
    own = alone.generate(b, max_new_tokens=12, mode="hybrid")
    assert second.tokens == own.tokens == again.tokens == hf_greedy(model, b, 12)[:len(own.tokens)]
    assert first.tokens == alone.generate(a, max_new_tokens=12, mode="baseline").tokens
    assert sampled.tokens == alone.generate(b, max_new_tokens=12, mode="baseline", temperature=0.8, seed=1).tokens
    for copied, computed in zip(second.state.cache.layers, own.state.cache.layers):
        assert torch.equal(copied.keys[..., :len(b), :], computed.keys[..., :len(b), :])
        assert torch.equal(copied.values[..., :len(b), :], computed.values[..., :len(b), :])


def test_no_reuse_where_a_prompts_bits_depend_on_its_cuts():
    model = tiny_model("llama")
    for eng in (Engine(model, plan=Plan(kernels="default")),
                Engine(tiny_model("mistral", sliding_window=24), plan=Plan(kernels="gemv"))):
        assert not shares_prefixes(eng)
        sched = Scheduler(eng, max_batch=2).start()
        try:
            prompt = list(range(10, 40))
            sched.submit(prompt, max_new_tokens=4, mode="baseline").wait()
            assert sched.submit(prompt, max_new_tokens=4, mode="baseline").wait().stats.prefill_tokens == len(prompt)
        finally:
            sched.close(timeout=60)
        assert sched.reused_tokens == 0
