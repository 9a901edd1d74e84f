"""Whole decoding passes in one C call (medusa/runtime/native.py, decoder.c), built here with the
real C compiler, against the model's own modules on tiny real Llama, Qwen2 and Mistral models."""

from __future__ import annotations

import pytest
import torch
from tiny import hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.loader import init_heads_for
from medusa.runtime import clock, native, packed, rows
from medusa.runtime import hf as kv
from medusa.runtime.kernels import PackedLinears
from medusa.serving.scheduler import Scheduler
from tests.test_rows import PARENT, prefilled, tree

ARCHS = ["llama", "qwen2", "mistral"]


def model_for(arch: str):
    # qwen2 and mistral with a window shorter than the longer prefix: their layers see less
    return tiny_model(arch, sliding_window=24 if arch != "llama" else None)


def packed_pass(model, items, tokens, through, layers=None):
    """One packed pass over ``items`` ``(cache, past, ancestor, depth)`` with the one-call
    attention's layout, through ``through``: (logits, hidden, native seconds)."""
    segments, at = [], 0
    for cache, _, ancestor, _ in items:
        segments.append(packed.Segment(cache, slice(at, at + ancestor.shape[0]), None))
        at += ancestor.shape[0]
    layout = rows.layout_for(model, [(p, a, d) for _, p, a, d in items])
    positions = torch.cat([p + d for _, p, _, d in items])[None]
    with clock.counting() as totals:
        logits, hidden = packed.forward(model, tokens[None], positions, segments, layout=layout, through=through,
                                        starts=[p for _, p, _, _ in items], layers=layers)
    return logits, hidden, totals["native"]


@pytest.mark.parametrize("arch", ARCHS)
def test_one_call_pass_matches_the_models_modules(arch):
    """Trees of two sequences: logits, the layers' inputs (EAGLE-3 features) and the keys written to
    each cache equal the module path's to float32 rounding."""
    model = model_for(arch)
    assert native.supported(model) is None
    ancestor, depth = tree(PARENT)
    tokens = torch.randint(3, 96, (8,), generator=torch.Generator().manual_seed(1))
    got = {}
    with torch.inference_mode(), PackedLinears(model, kernels="gemv"):
        for through in (kv.forward, native.forward):
            caches = [prefilled(model, 40, 0), prefilled(model, 7, 1)]
            items = [(caches[0], 40, ancestor, depth), (caches[1], 7, *tree([-1, 0]))]
            logits, hidden, seconds = packed_pass(model, items, tokens, through, layers=(0, 1))
            assert (seconds > 0) == (through is native.forward)  # the one-call pass really ran
            got[through] = logits, hidden, [(c.layers[1].keys, c.layers[1].values) for c in caches]
    (a_logits, a_hidden, a_kv), (b_logits, b_hidden, b_kv) = got[kv.forward], got[native.forward]
    assert torch.allclose(a_logits, b_logits, atol=1e-5, rtol=1e-5)
    assert torch.allclose(a_hidden, b_hidden, atol=1e-5, rtol=1e-5)
    for (ka, va), (kb, vb) in zip(a_kv, b_kv):
        assert ka.shape == kb.shape and torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    assert not torch.equal(b_logits[:6], b_logits[6:8].repeat(3, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_rows_bits_do_not_depend_on_the_pass(arch):
    """A sequence's tree alone, beside another sequence, and its nodes' later one-token passes:
    the same bits (what keeps batched decoding identical to decoding alone)."""
    model = model_for(arch)
    chain = tree([-1, 0, 1])
    tokens = torch.tensor([11, 23, 35])
    other = torch.tensor([40, 41, 42, 43, 44, 45])
    with torch.inference_mode(), PackedLinears(model, kernels="gemv"):
        alone, _, _ = packed_pass(model, [(prefilled(model, 30, 0), 30, *chain)], tokens, native.forward)
        both, _, _ = packed_pass(model, [(prefilled(model, 9, 2), 9, *tree(PARENT)),
                                         (prefilled(model, 30, 0), 30, *chain)], torch.cat([other, tokens]),
                                 native.forward)
        cache, steps = prefilled(model, 30, 0), []
        for i, token in enumerate(tokens):
            logits, _, _ = packed_pass(model, [(cache, 30 + i, *tree([-1]))], token[None], native.forward)
            steps.append(logits)
    assert torch.equal(alone, both[6:])
    assert torch.equal(alone, torch.cat(steps))


def test_outside_packed_gemv_copies_passes_take_the_modules():
    """Without a live gemv PackedLinears (torch's kernels, a prefill) the modules run, same results."""
    model = model_for("llama")
    with torch.inference_mode():
        items = [(prefilled(model, 12, 0), 12, *tree(PARENT))]
        tokens = torch.arange(6) + 3
        logits, _, seconds = packed_pass(model, items, tokens, native.forward)
        assert seconds == 0
        reference, _, _ = packed_pass(model, [(prefilled(model, 12, 0), 12, *tree(PARENT))], tokens, kv.forward)
        ids = torch.tensor([[5, 6, 7]])
        with PackedLinears(model, kernels="gemv"):  # an ordinary pass (no layout): the modules
            out = native.forward(model, ids, torch.arange(3)[None], kv.new_cache(), None)
            ref = kv.forward(model, ids, torch.arange(3)[None], kv.new_cache(), None)
    assert torch.equal(logits, reference)
    assert torch.equal(out[0], ref[0])


def test_other_decoders_say_why_not():
    assert "gemma3_text" in native.supported(tiny_model("gemma3"))
    half = tiny_model("llama").to(torch.bfloat16)
    assert "float32" in native.supported(half)


@pytest.mark.parametrize("mode", ["baseline", "hybrid", "hybrid@eagle3"])
def test_decoding_on_one_call_passes_is_the_targets_greedy_alone_and_batched(mode):
    """An engine on the gemv kernels decodes through one-call passes: each request's tokens are
    the target's own greedy ones, alone and scheduled beside others (a tight row budget)."""
    model = tiny_model("llama")
    heads = {"hybrid": lambda: init_heads_for(model, num_heads=3),
             "hybrid@eagle3": lambda: init_eagle3_for(model, 3)}.get(mode, lambda: None)()
    eng = Engine(model, heads=heads, plan=Plan(kernels="gemv"))
    assert eng.passes.forward is native.forward
    assert any("one C call" in line for line in eng.describe())
    assert any("modules" in line for line in Engine(model).describe())  # torch's kernels: the modules run
    run = mode.split("@")[0]
    prompts = [[5, 17, 33, 9, 41, 12], [9, 8, 7] * 7, list(range(10, 40))]
    with clock.counting() as totals:
        ref = [eng.generate(p, max_new_tokens=20, mode=run).tokens for p in prompts]
    assert totals["native"] > 0
    for p, tokens in zip(prompts, ref):
        assert tokens == hf_greedy(model, p, 20)[:len(tokens)]
    sched = Scheduler(eng, max_batch=3, row_budget=6).start()
    try:
        streams = [sched.submit(p, max_new_tokens=20, mode=run) for p in prompts]
        got = [[t for chunk in s for t in chunk] for s in streams]
    finally:
        sched.close(timeout=60)
    assert got == ref


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompt_prefilled_in_one_call_passes_holds_the_same_bits_however_it_is_cut(arch):
    """Prefill through one-call passes (the engine's, where its decoding passes are one call):
    a prompt's keys, values and last logits are the same bits in one pass, cut at other places,
    or continued after a shared prefix; and faster paths never ran the modules."""
    model = tiny_model(arch)
    eng = Engine(model, plan=Plan(kernels="gemv"))
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(4))
    got = []
    with torch.inference_mode(), eng.owned(), clock.counting() as totals:
        for cuts in ([40], [13, 27], [1, 39], [24, 1, 15]):
            cache, at = eng.passes.new_cache(), 0
            for n in cuts:
                logits, _ = eng.passes.prefill(cache, ids[:, at:at + n], at, 8)
                at += n
            got.append((logits, [(x.keys.clone(), x.values.clone()) for x in cache.layers]))
    assert totals["native"] > 0 and totals["attention"] == 0  # one-call passes only
    for logits, layers in got[1:]:
        assert torch.equal(logits, got[0][0])
        assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(layers, got[0][1]))
    prompt = ids[0].tolist()
    assert eng.generate(prompt, max_new_tokens=12, mode="baseline").tokens == hf_greedy(model, prompt, 12)
