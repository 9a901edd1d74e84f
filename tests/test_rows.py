"""One attention call per layer for every row of a pass (medusa/runtime/rows.py, attention.c),
built here with the real C compiler, against torch's masked attention on tiny real models."""

from __future__ import annotations

import pytest
import torch

from medusa.runtime import hf as kv
from medusa.runtime import packed, rows
from medusa.runtime.kernels import PackedLinears
from tests.tiny import tiny_model

# a tree of 6 nodes: 0 -> 1 -> 3, 0 -> 2 -> 4, 2 -> 5 (root first, parents before children)
PARENT = [-1, 0, 0, 1, 2, 2]


def tree(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    ancestor = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestor[i] |= ancestor[p]
            depth[i] = depth[p] + 1
    return ancestor, depth


def prefilled(model, n: int, seed: int):
    cache = kv.new_cache()
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    kv.forward(model, ids, torch.arange(n)[None], cache, None)
    return cache


def run(model, items, tokens, one_call: bool):
    """A packed pass over ``items`` ``(cache, past, ancestor, depth)``: logits ``[R, V]``."""
    segments, at = [], 0
    for cache, past, ancestor, depth in items:
        n = ancestor.shape[0]
        mask = None if one_call else kv.tree_attention_mask(model, past, ancestor, depth, model.dtype)
        segments.append(packed.Segment(cache, slice(at, at + n), mask))
        at += n
    layout = rows.layout_for(model, [(p, a, d) for _, p, a, d in items]) if one_call else None
    positions = torch.cat([p + d for _, p, _, d in items])[None]
    logits, _ = packed.forward(model, tokens[None], positions, segments, layout=layout)
    return logits


def test_layout_names_each_rows_run_and_its_other_ancestors():
    ancestor, depth = tree(PARENT)
    plan = rows.layout([(10, ancestor, depth), (4, *tree([-1, 0]))])
    assert plan.seg.tolist() == [0] * 6 + [1, 1]
    assert plan.hi.tolist() == [11, 12, 11, 12, 11, 11, 5, 6]  # the root, and node 1 for nodes 1 and 3
    extras = [plan.extra[plan.start[r]:plan.start[r + 1]].tolist() for r in range(8)]
    assert extras == [[], [], [12], [13], [12, 14], [12, 15], [], []]
    assert plan.lo.tolist() == [0] * 8
    window = rows.layout([(10, ancestor, depth)], window=8)
    assert window.lo.tolist() == [3, 4, 4, 5, 5, 5]  # position 10 + depth sees the 8 positions up to itself
    with pytest.raises(ValueError, match="sliding window"):
        rows.layout([(10, ancestor, depth)], window=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_one_call_matches_masked_attention(arch):
    """Trees of two sequences in one pass: the kernel's logits are torch's masked ones, to float32 rounding
    (gemma3: sliding-window and full layers; qwen2: a window on some layers)."""
    model = tiny_model(arch, sliding_window=24 if arch != "llama" else None)
    assert rows.supported(model) is None
    ancestor, depth = tree(PARENT)
    tokens = torch.randint(3, 96, (8,), generator=torch.Generator().manual_seed(1))
    got = {}
    with torch.inference_mode():
        for one_call in (False, True):
            items = [(prefilled(model, 40, 0), 40, ancestor, depth), (prefilled(model, 7, 1), 7, *tree([-1, 0]))]
            got[one_call] = run(model, items, tokens, one_call)
    assert torch.allclose(got[True], got[False], atol=1e-5, rtol=1e-5)
    assert not torch.equal(got[True][:6], got[True][6:8].repeat(3, 1))  # the rows are really different


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_pass(arch):
    """With row-invariant linear kernels (gemv), a sequence's rows are bitwise the same alone and
    beside other sequences of other lengths, and a tree node's row is bitwise the one-token pass of
    that token once its ancestors are accepted: the promise batched and speculative greedy
    decoding rest on (windowed models with a window shorter than the prefixes)."""
    model = tiny_model(arch, sliding_window=24 if arch != "llama" else None)
    ancestor, depth = tree(PARENT)
    tokens = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), PackedLinears(model, kernels="gemv"):
        alone = run(model, [(prefilled(model, 33, 0), 33, ancestor, depth)], tokens[:6], True)
        others = [(prefilled(model, 5, 1), 5, *tree([-1, 0])), (prefilled(model, 50, 2), 50, *tree([-1]))]
        batched = run(model, [others[0], (prefilled(model, 33, 0), 33, ancestor, depth), others[1]],
                      torch.cat([tokens[6:8], tokens[:6], tokens[8:]]), True)
        assert torch.equal(batched[2:8], alone)
        cache = prefilled(model, 33, 0)
        run(model, [(cache, 33, ancestor, depth)], tokens[:6], True)
        kv.keep_nodes(cache, 33, torch.tensor([0, 2]), contiguous=False)  # accept 0 -> 2
        later = run(model, [(cache, 35, *tree([-1]))], tokens[5:6], True)  # node 5, a child of 2
        assert torch.equal(later[0], alone[5])


def test_unsupported_models_say_why():
    model = tiny_model("llama").to(torch.bfloat16)
    assert "float32" in rows.supported(model)
    odd = tiny_model("llama", head_dim=12, hidden_size=48)
    assert "head size 12" in rows.supported(odd)


def test_one_write_per_layer_leaves_each_cache_as_its_own_update_would():
    """The one-call pass writes every segment's new keys and values into its cache's buffer in one
    C call per layer (packed.PackedCache with starts); the caches then hold what per-segment
    updates leave, at the right lengths, and a buffer grows where it is full."""
    model = tiny_model("llama")
    ancestor, depth = tree(PARENT)
    tokens = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(3))
    caches: dict[bool, list] = {}
    with torch.inference_mode(), PackedLinears(model, kernels="gemv"):
        for one_write in (False, True):  # the same one-call attention; the writes differ
            # 254 + 6 rows outgrow the first 256-position buffer
            caches[one_write] = [prefilled(model, 254, 0), prefilled(model, 9, 1)]
            items = [(caches[one_write][0], 254, ancestor, depth), (caches[one_write][1], 9, *tree([-1]))]
            layout = rows.layout_for(model, [(p, a, d) for _, p, a, d in items])
            segments = [packed.Segment(c, s, None) for c, s in zip(caches[one_write], (slice(0, 6), slice(6, 7)))]
            packed.forward(model, tokens[None], torch.cat([254 + depth, torch.tensor([9])])[None], segments,
                           layout=layout, starts=[254, 9] if one_write else None)
    for fast, slow in zip(caches[True], caches[False]):
        assert kv.cache_length(fast) == kv.cache_length(slow)
        for a, b in zip(fast.layers, slow.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert kv.cache_length(caches[True][0]) == 260


def test_rows_over_several_key_chunks_match_and_keep_their_bits():
    """A long context splits each row's key list into chunks of 512 keys merged in order
    (attention.c): past 1,022 cached tokens the tree's rows straddle two chunk boundaries, some
    inside their extra ancestors. They equal torch's masked attention to float32 rounding, and a
    row's bits are the same alone, beside a short sequence, and as the later one-token pass."""
    model = tiny_model("llama", max_position_embeddings=2048)
    ancestor, depth = tree(PARENT)
    tokens = torch.randint(3, 96, (8,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        masked = run(model, [(prefilled(model, 1022, 0), 1022, ancestor, depth)], tokens[:6], False)
        with PackedLinears(model, kernels="gemv"):
            alone = run(model, [(prefilled(model, 1022, 0), 1022, ancestor, depth)], tokens[:6], True)
            short = (prefilled(model, 5, 1), 5, *tree([-1, 0]))
            batched = run(model, [short, (prefilled(model, 1022, 0), 1022, ancestor, depth)],
                          torch.cat([tokens[6:8], tokens[:6]]), True)
            cache = prefilled(model, 1022, 0)
            run(model, [(cache, 1022, ancestor, depth)], tokens[:6], True)
            kv.keep_nodes(cache, 1022, torch.tensor([0, 2]), contiguous=False)  # accept 0 -> 2
            later = run(model, [(cache, 1024, *tree([-1]))], tokens[4:5], True)  # node 4, a child of 2
    assert torch.allclose(alone, masked, atol=1e-5, rtol=1e-5)
    assert torch.equal(batched[2:], alone)
    assert torch.equal(later[0], alone[4])


def _kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: rows.Layout, status: int = 0) -> torch.Tensor:
    """attention.c over one sequence's keys and values ``[1, H, S, D]`` for queries ``[1, H, n, D]``
    (one query head per KV head): ``[n, H, D]``."""
    import ctypes

    from medusa.runtime import gemv

    _, heads, n, dim = q.shape
    k_at, v_at = (ctypes.c_int64 * 1)(keys.data_ptr()), (ctypes.c_int64 * 1)(values.data_ptr())
    strides = (ctypes.c_int64 * 2)(keys.stride(1), keys.stride(2))
    out = torch.empty(n, heads, dim)
    done = gemv.library().medusa_rows_attention(
        q.data_ptr(), q.stride(1), q.stride(2), n, heads, heads, dim, dim ** -0.5, ctypes.addressof(k_at),
        ctypes.addressof(v_at), ctypes.addressof(strides), ctypes.addressof(strides) + 8, plan.seg.data_ptr(),
        plan.lo.data_ptr(), plan.hi.data_ptr(), plan.start.data_ptr(), plan.extra.data_ptr(), out.data_ptr(),
        torch.get_num_threads())
    assert done == status  # 0: computed; -1: a shape the kernel refuses
    return out


@pytest.mark.parametrize("dim", [64, 128])
def test_queries_weighed_together_keep_the_bits_each_gets_alone(dim):
    """Where several queries see the same block of keys, attention.c weighs the values for up to six
    of them at once (heads of 64 or 128 on AVX-512; with AVX2 one at a time, both sizes taken), each
    query's sums still taken in its own key order: eight chained rows over 700 cached tokens (two key
    chunks) give each row the bits of its own call, where it is the only query of its KV head and
    weighs alone, and float64's values."""
    past, n, heads = 700, 8, 4
    gen = torch.Generator().manual_seed(dim)
    keys, values = (torch.randn(1, heads, past + n, dim, generator=gen) for _ in range(2))
    q = torch.randn(1, heads, n, dim, generator=gen)
    together = _kernel(q, keys, values, rows.layout([(past, torch.ones(n, n, dtype=torch.bool).tril_(),
                                                      torch.arange(n))]))
    for i in range(n):  # row i alone sees the same keys: the prefix and its ancestors, in order
        alone = _kernel(q[:, :, i:i + 1].contiguous(), keys, values,
                        rows.layout([(past + i, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))]))
        assert torch.equal(alone[0], together[i]), i
        k, v = keys[0, :, :past + i + 1].double(), values[0, :, :past + i + 1].double()
        weights = torch.softmax(q[0, :, i:i + 1].double() @ k.transpose(1, 2) * dim ** -0.5, dim=-1)
        assert torch.allclose(together[i].double(), (weights @ v)[:, 0], atol=1e-5), i


def test_the_head_sizes_the_kernel_takes_are_the_ones_the_engine_routes_to_it():
    """rows.supported_shape asks the built library: heads of 64 and 128 on every lane width (AVX2
    included), not 256 nor a size off the lanes; and a shape it refuses, the kernel refuses too."""
    from medusa.runtime import gemv

    lanes = gemv.library().medusa_attention_lanes()
    assert rows.supported_shape(9, 3, 64) is None and rows.supported_shape(32, 8, 128) is None
    assert "head size 256" in rows.supported_shape(8, 8, 256)
    assert rows.supported_shape(8, 8, lanes + 1) is not None
    q = torch.randn(1, 1, 1, 256)
    keys = torch.randn(1, 1, 4, 256)
    plan = rows.layout([(3, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))])
    _kernel(q, keys, keys, plan, status=-1)  # the kernel's own refusal of what supported_shape refuses
