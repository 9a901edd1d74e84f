"""Batch-invariant verification (medusa/runtime/exact.py) in bfloat16: a tree pass's row is
bit-identical to the one-token passes of the same tokens, so greedy speculation in every mode
emits exactly the engine's own baseline tokens."""

import contextlib

import pytest
import torch
from test_draft import noisy_copy
from test_engine import random_heads
from tiny import tiny_model

from medusa.autotune.device import MIN_ROWS, _order_sensitive, invariant_rows, linear_invariant_rows
from medusa.autotune.dtype import dtype_rule
from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.decoding.tree import compile_tree
from medusa.errors import MedusaError
from medusa.runtime import exact
from medusa.runtime import hf as kv
from medusa.runtime.exact import EXACT_MAX_ROWS, exact_attention, is_exact, set_exact
from medusa.runtime.kernels import PackedLinears, onednn_available

ARCHS4 = ("llama", "qwen2", "mistral", "gemma3")  # gemma3: sliding and full layers, softcapped logits
PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]
PREFIX = 40


def _tree_vs_one_token(model, static: bool, prefix: int = PREFIX) -> int:
    """Rows of a tree pass whose logits differ (bitwise) from a one-token-at-a-time pass
    over the node's ancestors after the same prompt."""
    dtype, cpu = model.dtype, torch.device("cpu")
    tree = compile_tree(PATHS)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 96, (1, prefix), generator=g)
    tokens = torch.randint(3, 96, (tree.num_nodes,), generator=g)
    width = prefix + 88 if static else None

    def prefill():
        cache = kv.new_static_cache(model, width) if static else kv.new_cache()
        mask = kv.causal_mask(model, 0, prefix, dtype, cpu, width) if static else None
        kv.forward(model, prompt, torch.arange(prefix)[None], cache, mask)
        return cache

    with torch.inference_mode():
        cache = prefill()
        mask = kv.tree_attention_mask(model, prefix, tree.ancestor, tree.depth, dtype, width)
        tree_logits, _ = kv.forward(model, tokens[None], (prefix + tree.depth)[None], cache, mask)  # [N, V]
        differing = 0
        for node in range(tree.num_nodes):
            cache = prefill()
            for step, a in enumerate(tree.ancestor[node].nonzero()[:, 0].tolist()):  # root .. node
                mask = kv.causal_mask(model, prefix + step, 1, dtype, cpu, width) if static else None
                one, _ = kv.forward(model, tokens[a].view(1, 1), torch.tensor([[prefix + step]]), cache, mask)
            differing += not torch.equal(one[0], tree_logits[node])
    return differing


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("prefix", [PREFIX, 150])  # 150: rows share a head of prompt keys (exact.py's split)
@pytest.mark.parametrize("arch", ARCHS4)
def test_tree_rows_equal_one_token_passes_bit_for_bit(arch, static, prefix):
    model = tiny_model(arch).to(torch.bfloat16)
    set_exact(model, True)
    differing = _tree_vs_one_token(model, static, prefix)
    nodes = len(PATHS) + 1
    rows = invariant_rows(model, limit=nodes, prefix=prefix)
    if rows < nodes:
        # this device's matmul kernels round a pass this large differently from one-token
        # passes (no attention can fix that): the engine never verifies one here
        assert Engine(model, plan=Plan(max_rows=rows)).max_rows < nodes
        pytest.skip(f"this CPU's matmuls keep only {rows} of {nodes} rows equal to one-token passes: the cap was checked")
    assert differing == 0  # attention was the only row-count dependent op, and exact attention fixes it


WIDE = [(i,) for i in range(6)] + [(i, j) for i in range(4) for j in range(4)] + [(0, 0, k) for k in range(5)] \
    + [(0, 0, 0, 0), (0, 0, 0, 0, 0)]  # 30 nodes


@pytest.fixture(params=["flash", "matmul"])
def attention_path(request, monkeypatch):
    """exact.py's two ways: torch's CPU flash kernel per row (CPUs) and batched float32 matmuls
    (other devices, softcapped logits), both run here."""
    if request.param == "matmul":
        monkeypatch.setattr(exact, "_FLASH", None)
    else:
        assert exact._FLASH is not None  # this torch ships the CPU flash kernel the CPU path uses
    return request.param


@pytest.mark.parametrize("paths", [PATHS, WIDE], ids=["10-nodes", "30-nodes"])
@pytest.mark.parametrize("prefix", [40, 150, 700])  # 150, 700: rows share a head of prompt keys
@pytest.mark.parametrize("kv_heads,g,dim", [(3, 3, 64), (4, 4, 128), (2, 1, 64), (2, 8, 128), (1, 2, 256)])
def test_exact_attention_rows_equal_one_token_rows_for_real_head_shapes(kv_heads, g, dim, prefix, paths,
                                                                        attention_path):
    # The attention function alone, on the head shapes of real targets (SmolLM2: 3 KV heads of
    # 3 queries, D 64; Llama-3-8B and Mistral-7B: g 4, D 128; MHA; Gemma: D 256): each node's
    # output row in the tree pass is bit-identical to its one-token pass over prompt + ancestors.
    # A product with the shared head of g rows in a one-token pass against g x nodes rows in the
    # tree pass rounded differently on CPUs (exact._shared_product), which tiny models (D 16) miss.
    tree = compile_tree(paths)
    n, length = tree.num_nodes, prefix + tree.num_nodes
    gen = torch.Generator().manual_seed(prefix + dim)
    key, value = (torch.randn(1, kv_heads, length, dim, generator=gen).bfloat16() for _ in range(2))
    query = torch.randn(1, kv_heads * g, n, dim, generator=gen).bfloat16()
    allowed = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree.ancestor.bool()], 1)
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)
    tree_out, _ = exact_attention(None, query, key, value, mask[None, None])  # [1, n, H, D]
    differing = []
    for node in range(n):
        keys = torch.cat([torch.arange(prefix), prefix + tree.ancestor[node].nonzero()[:, 0]])
        one, _ = exact_attention(None, query[:, :, node:node + 1], key[:, :, keys], value[:, :, keys], None)
        if not torch.equal(one[0, 0], tree_out[0, node]):
            differing.append(node)
    assert differing == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [20, 150, 700])
def test_exact_attention_computes_attention(prefix, dtype, attention_path):
    # Invariance is worthless if the numbers are wrong: every row of a 30-node tree pass after a
    # prompt, in a batch of 2 whose second entry's visible keys do not start at slot 0 (a window:
    # all keys gathered), matches float64 attention to the dtype's rounding.
    tree = compile_tree(WIDE)
    n, length, kv_heads, g, dim = tree.num_nodes, prefix + tree.num_nodes, 3, 3, 64
    gen = torch.Generator().manual_seed(prefix)
    key, value = (torch.randn(2, kv_heads, length, dim, generator=gen) for _ in range(2))
    query = torch.randn(2, kv_heads * g, n, dim, generator=gen)
    allowed = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree.ancestor.bool()], 1).expand(2, n, length).clone()
    allowed[1, :, : prefix // 2] = False  # batch entry 1: a window that starts past slot 0
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(g, 1), value.double().repeat_interleave(g, 1),
        attn_mask=mask.double()).transpose(1, 2)
    for b in (1, 2):  # 1: rows past 64 keys read a shared head in place and a gathered tail (exact.py)
        out, _ = exact_attention(None, query[:b].to(dtype), key[:b].to(dtype), value[:b].to(dtype), mask[:b].to(dtype))
        assert out.dtype == dtype and out.shape == expected[:b].shape
        torch.testing.assert_close(out.double(), expected[:b], atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_attention_with_an_additive_bias_on_the_shared_head(dtype, attention_path):
    # A mask that adds finite values to visible keys (ALiBi-like) reaches the shared head's call
    # as one bias row per query: still attention, and still each row's one-token result.
    tree = compile_tree(PATHS)
    prefix, kv_heads, g, dim = 150, 3, 3, 64
    n, length = tree.num_nodes, prefix + tree.num_nodes
    gen = torch.Generator().manual_seed(3)
    key, value = (torch.randn(1, kv_heads, length, dim, generator=gen) for _ in range(2))
    query = torch.randn(1, kv_heads * g, n, dim, generator=gen)
    allowed = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree.ancestor.bool()], 1)
    bias = -torch.rand(n, length, generator=gen)  # per row and key
    mask = bias.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(g, 1), value.double().repeat_interleave(g, 1),
        attn_mask=mask.to(dtype).double()).transpose(1, 2)
    out, _ = exact_attention(None, query.to(dtype), key.to(dtype), value.to(dtype), mask.to(dtype))
    torch.testing.assert_close(out.double(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    for node in range(n):
        keys = torch.cat([torch.arange(prefix), prefix + tree.ancestor[node].nonzero()[:, 0]])
        one, _ = exact_attention(None, query[:, :, node:node + 1].to(dtype), key[:, :, keys].to(dtype),
                                 value[:, :, keys].to(dtype), mask[:, :, node:node + 1, keys].to(dtype))
        assert torch.equal(one[0, 0], out[0, node]), node


def test_sdpa_tree_rows_differ_in_bfloat16():
    # The probe above can fail: with the stock SDPA kernel some tree rows round differently
    # from their one-token passes (the query length changes the kernel's blocking).
    differing = 0
    for arch in ARCHS4:
        model = tiny_model(arch).to(torch.bfloat16)
        set_exact(model, False)
        differing += _tree_vs_one_token(model, static=False)
    assert differing > 0


@pytest.mark.parametrize("kernels", ["default", "onednn"])  # onednn: packed bf16 weights (kernels.py)
@pytest.mark.parametrize("arch", ARCHS4)
def test_bfloat16_speculation_equals_baseline_in_every_mode(arch, kernels):
    model = tiny_model(arch).to(torch.bfloat16)
    if kernels == "onednn" and not onednn_available("cpu", torch.bfloat16):
        # a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT packs no bf16 weights: a one-line refusal
        with pytest.raises(MedusaError, match="oneDNN torch.bfloat16 linears.*kernels='default'"):
            Engine(model, plan=Plan(kernels="onednn"))
        pytest.skip("this CPU packs no oneDNN bfloat16 weights: only their refusal was checked")
    set_exact(model, True)
    # the largest pass whose rows all equal their one-token passes on this device with these
    # kernels (they may block differently past some row count); the engine verifies at most that
    with PackedLinears(model) if kernels == "onednn" else contextlib.nullcontext():
        rows = invariant_rows(model, limit=24, prefix=PREFIX, kernels=kernels)
    if rows < MIN_ROWS:
        # bfloat16 cannot be exact here even for small trees: the dtype pick must refuse it
        assert dtype_rule(True, "AMX", rows, 0.3)[0] == "float32"
        pytest.skip(f"bfloat16 keeps only {rows} rows exact on this CPU: only the dtype pick's refusal was checked")
    draft = noisy_copy(tiny_model(arch), 0.02).to(torch.bfloat16)
    eng = Engine(model, heads=random_heads(model, 0).to(torch.bfloat16), tree=PATHS, draft=draft,
                 proposer_config=ProposerConfig(draft_tokens=3, check_drafting=False),
                 plan=Plan(max_rows=rows, kernels=kernels))
    assert eng.exact and is_exact(model)  # the default in half precision
    assert eng.max_rows == rows
    prompt = [5, 17, 33, 9, 41, 12, 5, 17, 33]
    n = 48
    base = eng.generate(prompt, max_new_tokens=n, mode="baseline")
    assert len(base.tokens) == n or base.finish_reason == "eos"
    for mode in ("medusa", "hybrid", "lookup", "draft"):
        out = eng.generate(prompt, max_new_tokens=n, mode=mode)
        assert out.tokens == base.tokens, mode
        assert out.stats.steps < base.stats.steps, mode  # it did speculate and accept


def test_engine_verifies_at_most_max_rows_per_pass():
    model = tiny_model("llama")
    seen = []
    eng = Engine(model, heads=random_heads(model, 0), tree=PATHS, plan=Plan(max_rows=4))
    real = eng.passes.forward

    def watched(model, tokens, *args, **kwargs):
        seen.append(tokens.shape[1])
        return real(model, tokens, *args, **kwargs)

    eng.passes.forward = watched
    prompt = [5, 17, 33, 9, 41, 12, 5, 17, 33]
    base = eng.generate(prompt, max_new_tokens=32, mode="baseline")
    for mode in ("medusa", "hybrid"):
        seen.clear()
        out = eng.generate(prompt, max_new_tokens=32, mode=mode)
        assert out.tokens == base.tokens, mode
        assert seen and max(seen) == 4, mode  # the 10-node tree was cut to its first 4 nodes
    assert Engine(model, plan=Plan(exact=True)).max_rows == EXACT_MAX_ROWS  # exact passes are capped anyway
    with pytest.raises(MedusaError, match="max_rows"):
        Engine(model, plan=Plan(max_rows=0))


def test_invariant_rows_finds_the_first_pass_size_that_differs():
    model = tiny_model("llama").to(torch.bfloat16)
    set_exact(model, True)
    real_rows = invariant_rows(model, limit=12)
    from medusa.runtime import hf as kv_mod

    real_forward = kv_mod.forward

    def leaky(model, ids, pos, cache, mask, logits_rows=None):
        logits, hidden = real_forward(model, ids, pos, cache, mask, logits_rows)
        if ids.shape[1] >= 5:  # passes of 5 rows and more mix their rows
            logits = logits + logits.mean(0, keepdim=True)
        return logits, hidden

    kv_mod.forward = leaky
    try:
        assert invariant_rows(model, limit=12) == min(4, real_rows)
    finally:
        kv_mod.forward = real_forward


def test_linear_probe_inputs_change_with_any_summation_order():
    # linear_invariant_rows relies on its inputs exposing a kernel's changed summation order
    # (on random activations a changed order shows only where a bf16 rounding flips): summed
    # left to right, in 16 lanes (AVX-512) or in 8-term blocks, nearly every row gives another result.
    x = _order_sensitive(16, 576, torch.Generator().manual_seed(3))
    sequential = torch.zeros(16)
    for k in range(576):
        sequential += x[:, k]
    lanes = torch.zeros(16, 16)
    for k in range(0, 576, 16):
        lanes += x[:, k:k + 16]
    blocks = torch.zeros(16)
    for k in range(0, 576, 8):
        part = torch.zeros(16)
        for j in range(k, k + 8):
            part += x[:, j]
        blocks += part
    for a, b in ((sequential, lanes.sum(1)), (sequential, blocks), (blocks, lanes.sum(1))):
        assert (a != b).sum() >= 12  # of 16 rows (two orders may agree by chance, e.g. both 0)
    assert torch.equal(x.bfloat16().float(), x)  # exact in bfloat16: the probe tests the kernel, not the input's rounding


def test_invariant_rows_is_at_most_the_linear_probe():
    model = tiny_model("llama").to(torch.bfloat16)
    set_exact(model, True)
    assert 1 <= invariant_rows(model, limit=12) <= linear_invariant_rows(model, limit=12) <= 12


def test_exact_is_off_by_default_in_float32_and_can_be_forced():
    model = tiny_model("llama")
    assert not Engine(model).exact and not is_exact(model)
    assert Engine(model, plan=Plan(exact=True)).exact and is_exact(model)
    Engine(model, plan=Plan(exact=False))
    assert not is_exact(model)
