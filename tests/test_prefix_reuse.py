"""A scheduled greedy prompt starts after the prefix it shares with a finished one
(medusa/serving/scheduler.py): copied, not prefilled, with the very bits and tokens its own
prefill gives, on a tiny real model and the gemv kernels built here."""

from __future__ import annotations

import torch
from test_chunked_prefill import watch_chunks
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


def _engine():
    model = tiny_model("llama")
    return model, Engine(model, plan=Plan(kernels="gemv"))


def test_finished_prompts_are_kept_by_memory_not_count_and_free_their_slots():
    import gc

    model, eng = _engine()
    prompts = [[3 + i] + list(range(20 + i, 40 + i)) for i in range(7)]  # 21 tokens, no shared prefix
    sched = Scheduler(eng, max_batch=2).start()
    try:
        first = [sched.submit(p, max_new_tokens=6, mode="baseline").wait() for p in prompts]
        kept = sched._finished
        assert len(kept) == 7  # more than a fixed few
        assert kept.bytes == sum(len(p) + len(r.tokens) - 1 for p, r in zip(prompts, first)) * sched.kv_per_token
        del first
        gc.collect()
        assert sched.store.free == sched.store.slots  # copies, not the requests' KV store slots
        again = sched.submit(prompts[0], max_new_tokens=6, mode="baseline").wait()
    finally:
        sched.close(timeout=60)
    assert again.stats.prefill_tokens == 1  # the oldest of seven still served its whole prompt
    assert again.tokens == hf_greedy(model, prompts[0], 6)[:len(again.tokens)]


def test_the_memory_budget_drops_the_oldest_first():
    model, eng = _engine()
    prompts = [[3 + i] + list(range(20 + i, 40 + i)) for i in range(3)]
    per_answer = (len(prompts[0]) + 6) * kv_bytes(eng)
    sched = Scheduler(eng, max_batch=2, prefix_memory=2 * per_answer).start()
    try:
        for p in prompts:
            sched.submit(p, max_new_tokens=6, mode="baseline", ignore_eos=True).wait()
        assert len(sched._finished) == 2 and sched._finished.bytes <= 2 * per_answer
        oldest = sched.submit(prompts[0], max_new_tokens=6, mode="baseline", ignore_eos=True).wait()
        newest = sched.submit(prompts[2], max_new_tokens=6, mode="baseline", ignore_eos=True).wait()
    finally:
        sched.close(timeout=60)
    assert oldest.stats.prefill_tokens == len(prompts[0])  # dropped: prefilled whole
    assert newest.stats.prefill_tokens == 1
    assert oldest.tokens == hf_greedy(model, prompts[0], 6)
    none = Scheduler(eng, max_batch=2, prefix_memory=0)
    assert none._finished is None  # 0 keeps nothing


def test_a_conversations_next_turn_replaces_its_earlier_turn():
    model, eng = _engine()
    turn = list(range(10, 30))
    sched = Scheduler(eng, max_batch=2).start()
    try:
        one = sched.submit(turn, max_new_tokens=5, mode="baseline", ignore_eos=True).wait()
        history = turn + one.tokens + [7, 8, 9]
        two = sched.submit(history, max_new_tokens=5, mode="baseline", ignore_eos=True).wait()
        assert len(sched._finished) == 1  # the first turn's entry begins the second's: dropped for it
        assert sched._finished.longest(history + two.tokens)[1] == len(history) + len(two.tokens) - 1
    finally:
        sched.close(timeout=60)
    assert two.stats.prefill_tokens == len(history) - (len(turn) + len(one.tokens) - 1)
    assert two.tokens == hf_greedy(model, history, 5)


def kv_bytes(eng) -> int:
    from medusa.serving.scheduler import kv_bytes_per_token

    return kv_bytes_per_token(eng.model)


def test_a_prompt_past_a_shared_prefix_by_a_few_tokens_runs_them_in_the_decoding_pass():
    model, eng = _engine()
    shared = list(range(10, 40))
    b = shared + [9, 8]
    alone = Engine(model, plan=Plan(kernels="gemv")).generate(b, max_new_tokens=10, mode="baseline")
    for rows, fused in ((64, True), (0, False)):
        sched = Scheduler(eng, max_batch=2, prefill_rows=rows).start()
        passes = watch_chunks(sched)
        try:
            sched.submit(shared + [5, 6, 7], max_new_tokens=4, mode="baseline").wait()
            long = sched.submit(list(range(50, 90)), max_new_tokens=40, mode="baseline", ignore_eos=True)
            next(iter(long))  # running: the next prompt's prefill can share its pass
            second = sched.submit(b, max_new_tokens=10, mode="baseline").wait()
            long.wait()
        finally:
            sched.close(timeout=60)
        assert (len(b) - len(shared) in passes) == fused  # its two rows in one decoding pass
        assert second.stats.prefill_tokens == len(b) - len(shared)
        assert second.tokens == alone.tokens == hf_greedy(model, b, 10)[:len(alone.tokens)]
        for copied, computed in zip(second.state.cache.layers, alone.state.cache.layers):
            assert torch.equal(copied.keys[..., :len(b), :], computed.keys[..., :len(b), :])
            assert torch.equal(copied.values[..., :len(b), :], computed.values[..., :len(b), :])
