"""The static KV cache and the compiled verification pass decode exactly like the dynamic cache."""

import os

import pytest
import torch
from tiny import ARCHS, hf_greedy, tiny_model

from medusa.decoding import hf as kv
from medusa.decoding.engine import Engine
from medusa.models.heads import init_heads_for

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 33, 9, 41, 12]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_with_a_static_cache_equals_hf_generate(arch):
    # gemma3 mixes sliding-window and full layers: the widened masks must keep both rules
    model = tiny_model(arch, sliding_window=8) if arch in ("mistral", "gemma3") else tiny_model(arch)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, static_cache=True)
    for mode in ("baseline", "medusa", "lookup", "hybrid"):
        res = eng.generate(PROMPT, max_new_tokens=n, mode=mode)
        assert res.tokens == ref, mode
        assert kv.is_static(res.state.cache)
    assert max(eng.generate(PROMPT, max_new_tokens=n, mode="medusa").stats.accepted) > 1


def test_sampling_with_a_static_cache_matches_the_dynamic_cache():
    model = tiny_model("llama")
    heads = init_heads_for(model, num_heads=3)
    dynamic = Engine(model, heads=heads, tree=TREE)
    static = Engine(model, heads=heads, tree=TREE, static_cache=True)
    for seed in (0, 1, 2):
        a = dynamic.generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=seed)
        b = static.generate(PROMPT, max_new_tokens=30, temperature=1.0, seed=seed)
        assert a.tokens == b.tokens
        assert a.stats.accepted == b.stats.accepted


def test_reserve_regrows_and_keeps_the_cached_entries():
    model = tiny_model("llama")
    cache = kv.new_static_cache(model, 16)
    ids = torch.tensor([PROMPT])
    mask = kv.causal_mask(model, 0, len(PROMPT), model.dtype, ids.device, kv_len=16)
    with torch.inference_mode():
        kv.forward(model, ids, torch.arange(len(PROMPT))[None], cache, mask)
    before = [layer.keys[..., :len(PROMPT), :].clone() for layer in cache.layers]
    kv.reserve(cache, 300)
    assert kv.capacity(cache) == 512  # the next power of two
    assert kv.cache_length(cache) == len(PROMPT)
    for layer, old in zip(cache.layers, before):
        assert layer.keys.shape[-2] == 512
        assert torch.equal(layer.keys[..., :len(PROMPT), :], old)
    kv.reserve(cache, 100)  # already large enough: untouched
    assert kv.capacity(cache) == 512


def test_a_chat_turn_longer_than_the_first_regrows_the_reused_cache():
    model = tiny_model("qwen2", max_position_embeddings=1024)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, static_cache=True)
    first = eng.generate(PROMPT, max_new_tokens=10)
    small = kv.capacity(first.state.cache)
    follow = PROMPT + first.tokens + [7, 8, 9]
    reused = eng.generate(follow, max_new_tokens=small, state=first.state)  # needs more room than the first turn had
    assert kv.capacity(reused.state.cache) > small
    assert reused.tokens == hf_greedy(model, follow, small)


def test_the_mask_is_widened_to_the_capacity_with_the_rest_hidden():
    model = tiny_model("llama")
    ancestor = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1])
    narrow = kv.tree_attention_mask(model, 4, ancestor, depth, torch.float32)
    wide = kv.tree_attention_mask(model, 4, ancestor, depth, torch.float32, kv_len=10)
    assert wide.shape == (1, 1, 3, 10)
    assert torch.equal(wide[..., :7], narrow)
    assert (wide[..., 7:] == torch.finfo(torch.float32).min).all()
    with pytest.raises(ValueError, match="shorter"):
        kv.tree_attention_mask(model, 4, ancestor, depth, torch.float32, kv_len=6)


@pytest.mark.parametrize("backend", ["aot_eager", True])
def test_the_compiled_pass_decodes_the_same_tokens(backend, tmp_path, monkeypatch):
    # "aot_eager" traces the pass with dynamo and AOTAutograd; True is the real inductor
    # build (C++ kernels on the CPU, CUDA graphs on CUDA).
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    torch._dynamo.reset()
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch._dynamo sets
    model = tiny_model("llama")
    n = 30
    ref = hf_greedy(model, PROMPT, n)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, compile=backend)
    assert eng.static_cache
    first = eng.generate(PROMPT, max_new_tokens=n, mode="medusa")
    again = eng.generate(PROMPT[:-1] + [7], max_new_tokens=n, mode="medusa")  # the compiled graph, reused
    assert first.tokens == ref
    assert again.tokens == hf_greedy(model, PROMPT[:-1] + [7], n)
    # compiled kernels persist beside the cached models, for the next process
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    if backend is True:
        assert any(p.is_file() for p in (tmp_path / "inductor").rglob("*"))


def test_compiled_passes_are_padded_to_a_few_buckets_and_stay_exact():
    # Modes whose proposals vary in size (lookup's chain, hybrid's tree + chain, trees cut by
    # the token budget) run padded to PASS_BUCKETS: outputs unchanged, few distinct graphs.
    from medusa.decoding.engine import PASS_BUCKETS, pad_pass, pass_bucket

    assert [pass_bucket(n) for n in (1, 3, 5, 13, 17, 33, 600)] == [1, 4, 8, 16, 24, 48, 600]
    tokens, depth = torch.tensor([4, 5, 6]), torch.tensor([0, 1, 1])
    ancestor = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    t, d, a = pad_pass(tokens, depth, ancestor, 4)
    assert t.tolist() == [4, 5, 6, 0] and d.tolist() == [0, 1, 1, 0]
    assert a[:3, :3].equal(ancestor) and a[3].tolist() == [False, False, False, True] and not a[:3, 3].any()

    torch._dynamo.reset()
    model = tiny_model("llama")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, compile="aot_eager")
    sizes = []
    compiled = eng._pass

    def recording(model, ids, *args):
        sizes.append(ids.shape[1])
        return compiled(model, ids, *args)

    eng._pass = recording
    for prompt, n in ((PROMPT, 30), (PROMPT[:-1] + [7, 7, 7, 9], 21), ([3, 4, 5] * 4, 17)):
        ref = hf_greedy(model, prompt, n)
        for mode in ("lookup", "hybrid", "medusa"):
            assert eng.generate(prompt, max_new_tokens=n, mode=mode).tokens == ref, mode
    assert set(sizes) <= set(PASS_BUCKETS) and len(set(sizes)) <= 6, sorted(set(sizes))


def test_a_compile_cache_folder_the_user_chose_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    kv.persist_compiled(tmp_path / "medusa")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    kv.persist_compiled(tmp_path / "medusa")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "medusa")
