"""The EAGLE-3 and EAGLE drafter layers in one C call (medusa/runtime/drafter.py, decoder.c), built here with
the real C compiler, against the heads' own modules on a tiny real Llama target."""

from __future__ import annotations

import pytest
import torch
from tiny import hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.eagle_heads import additive_mask, init_eagle_for
from medusa.runtime import drafter
from medusa.runtime import hf as kv
from medusa.runtime.kernels import PackedLinears


def pairs(heads, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = heads.fc.in_features if heads.kind == "eagle3" else heads.config.hidden_size
    features = torch.randn(n, width, generator=g).to(heads.fc.weight.dtype)
    return features, torch.randint(3, heads.config.vocab_size, (n,), generator=g)


def new_heads(model, kind: str):
    if kind == "eagle3":
        return init_eagle3_for(model, 3)
    return init_eagle_for(model, 3, init="random", layout="eagle1" if kind == "eagle1" else "norms")


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "eagle1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_in_one_call_is_the_heads_modules(kind, dtype):
    """A prompt's pairs fed causally, then a draft level whose rows see the context, a drafted
    ancestor (not the pair before them) and themselves: outputs and the cached keys equal the
    modules' to float32 rounding (float32 heads), to bfloat16 rounding (bfloat16 heads: the modules
    compute in bfloat16, the C layer in float32 on the same weights). EAGLE heads in both layouts
    (with the input and final norms, and EAGLE-1's without)."""
    model = tiny_model("llama")
    heads = new_heads(model, kind).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    past = 40
    features, tokens = pairs(heads, past + 3, 0)
    causal = torch.ones(past, past, dtype=torch.bool).tril_()
    with torch.inference_mode(), PackedLinears(model, heads, kernels="gemv"):
        table = drafter.table(heads)
        assert table is not None and table.half == (dtype == torch.bfloat16)
        module_cache, cache = kv.new_cache(), drafter.DraftCache(table.kv_heads, table.dim)
        want = heads(features[:past], tokens[:past], torch.arange(past), module_cache, additive_mask(causal, dtype))
        got = drafter.step(heads, table, features[:past], tokens[:past], torch.arange(past), cache, causal)
        torch.testing.assert_close(got, want.float(), **tol)
        # a level of a draft tree: pair past (drafted), then two rows that each see it, not each other
        one = torch.ones(1, past + 1, dtype=torch.bool)
        heads(features[past:past + 1], tokens[past:past + 1], torch.tensor([past]), module_cache,
              additive_mask(one, dtype))
        drafter.step(heads, table, features[past:past + 1], tokens[past:past + 1], torch.tensor([past]), cache, one)
        level = torch.zeros(2, past + 3, dtype=torch.bool)
        level[:, :past + 1] = True
        level[0, past + 1] = level[1, past + 2] = True
        rows_ = slice(past + 1, past + 3)
        want = heads(features[rows_], tokens[rows_], torch.tensor([past + 1] * 2), module_cache,
                     additive_mask(level, dtype))
        got = drafter.step(heads, table, features[rows_], tokens[rows_], torch.tensor([past + 1] * 2), cache, level)
        torch.testing.assert_close(got, want.float(), **tol)
        keys = module_cache.layers[0].keys[0, :, :past + 3].float()
        torch.testing.assert_close(cache.keys[:, :cache.length], keys, **tol)
    assert cache.length == past + 3
    assert drafter.table(heads) is None  # outside the packed copies the modules draft


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_several_sequences_in_one_call_are_the_bits_of_a_call_each(kind):
    """Two sequences' rows (caches of 40 and 25 pairs, a causal prompt and a tree level) in one C
    call: every output and every cached pair bit for bit what a call per sequence gives."""
    model = tiny_model("llama")
    heads = new_heads(model, kind)
    lengths = (40, 25)
    with torch.inference_mode(), PackedLinears(model, heads, kernels="gemv"):
        table = drafter.table(heads)
        apart = [drafter.DraftCache(table.kv_heads, table.dim) for _ in lengths]
        joint = [drafter.DraftCache(table.kv_heads, table.dim) for _ in lengths]
        data = [pairs(heads, n + 2, seed) for seed, n in enumerate(lengths)]
        calls = []
        for (features, tokens), n in zip(data, lengths):
            calls.append([(features[:n], tokens[:n], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril_())])
            level = torch.zeros(2, n + 2, dtype=torch.bool)
            level[:, :n - 1] = True  # each row: the context but its last pair, then itself
            level[0, n] = level[1, n + 1] = True
            calls[-1].append((features[n:], tokens[n:], torch.tensor([n, n]), level))
        for round_ in range(2):
            alone = [drafter.step(heads, table, f, t, p, cache, v)
                     for (f, t, p, v), cache in zip([c[round_] for c in calls], apart)]
            together = drafter.step_many(heads, table, [(f, t, p, cache, v) for (f, t, p, v), cache
                                                        in zip([c[round_] for c in calls], joint)])
            assert all(torch.equal(a, b) for a, b in zip(alone, together))
        for a, b in zip(apart, joint):
            assert a.length == b.length and torch.equal(a.keys[:, :a.length], b.keys[:, :b.length])
            assert torch.equal(a.values[:, :a.length], b.values[:, :b.length])


def test_a_layout_names_each_rows_run_and_its_other_positions():
    visible = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    plan = drafter.layout_of(visible)
    assert plan.hi.tolist() == [3, 2, 1]
    assert [plan.extra[plan.start[r]:plan.start[r + 1]].tolist() for r in range(3)] == [[], [3], [2, 4]]


def test_the_cache_crops_slides_and_hands_its_pairs_to_the_modules():
    cache = drafter.DraftCache(2, 16)
    cache.reserve(300)  # grows past its first 256 positions
    cache.keys[:, :300] = torch.arange(300.0)[None, :, None]
    cache.values[:, :300] = -torch.arange(300.0)[None, :, None]
    cache.length = 300
    cache.crop(290)
    cache.drop_front(10)  # a sliding window: the kept pairs move to the front
    assert cache.length == 280 and cache.keys[0, 0, 0] == 10 and cache.keys[1, 279, 0] == 289
    module = cache.module_cache(torch.bfloat16)
    assert kv.cache_length(module) == 280 and module.layers[0].values.dtype == torch.bfloat16
    assert module.layers[0].values[0, 0, 5, 0] == -15
    # the modules' buffered cache slides the same way: the next pairs go after the kept ones
    module = cache.module_cache(torch.float32)
    kv.drop_front(module, 10)
    new = torch.full((1, 2, 2, 16), 7.0)
    module.update(new, -new, 0)
    keys = module.layers[0].keys[0, 0, :, 0].float()
    assert kv.cache_length(module) == 272 and keys[0] == 20 and keys[269] == 289 and keys[270:].tolist() == [7, 7]


@pytest.mark.parametrize("mode", ["eagle3", "eagle"])
def test_decoding_with_the_one_call_drafter_is_the_targets_greedy(monkeypatch, mode):
    """An engine on the gemv kernels drafts EAGLE-3 and EAGLE trees through the C layer (float32
    heads: the same drafts as the modules, so the same steps); its tokens are the target's greedy ones."""
    model = tiny_model("llama")
    # heads that start as the target's own rows or last layer: their drafts are often right
    heads = init_eagle3_for(model, 3) if mode == "eagle3" else init_eagle_for(model, 3)
    eng = Engine(model, heads=heads, plan=Plan(kernels="gemv"))
    calls = []
    real = drafter.step
    monkeypatch.setattr(drafter, "step", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [[5, 17, 33, 9, 41, 12], [9, 8, 7] * 7]
    runs = [eng.generate(p, max_new_tokens=20, mode=mode) for p in prompts]
    assert calls  # the C layer drafted
    for p, run in zip(prompts, runs):
        assert run.tokens == hf_greedy(model, p, 20)[:len(run.tokens)]
    monkeypatch.setenv("MEDUSA_ONE_CALL_DRAFTER", "0")
    modules = [eng.generate(p, max_new_tokens=20, mode=mode) for p in prompts]
    assert [r.tokens for r in modules] == [r.tokens for r in runs]
    assert sum(r.stats.steps for r in modules) == pytest.approx(sum(r.stats.steps for r in runs), abs=2)


def test_other_heads_say_why_not(monkeypatch):
    model = tiny_model("llama")
    heads = init_eagle3_for(model, 3)
    assert drafter.supported(heads) is None
    assert drafter.supported(init_eagle_for(model, 3)) is None
    assert "biases" in drafter.supported(init_eagle_for(tiny_model("qwen2"), 3))  # q/k/v biases: the modules
    assert "Gemma3DecoderLayer" in drafter.supported(init_eagle_for(tiny_model("gemma3"), 3))
    monkeypatch.setenv("MEDUSA_ONE_CALL_DRAFTER", "0")
    assert "MEDUSA_ONE_CALL_DRAFTER=0" in drafter.supported(heads)
