"""Heads in their own dtype (medusa/autotune/device.py, pick_draft_dtype): bfloat16 heads draft
beside a float32 target, the target verifies every token in float32, so outputs stay the
target's own; the dtype is picked by measuring the draft vocabulary's scoring, once, cached."""


import pytest
import torch
from test_eagle import noisy_eagle
from tiny import DRAFTING, hf_greedy, tiny_model
from tiny_heads import random_heads, target_folder

import medusa
from medusa.autotune.cache import PlanCache
from medusa.autotune.device import decide_draft_dtype
from medusa.autotune.planner import Planner, adopt_draft_dtype
from medusa.decoding.engine import Engine
from medusa.decoding.plan import Decision, Plan
from medusa.errors import MedusaError
from medusa.runtime.int8 import int8_available
from medusa.runtime.kernels import onednn_available

PROMPT = [1, 5, 9, 12, 40, 7, 7, 3, 22, 5, 9, 17]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize("kernels", ["default", "onednn"])
def test_bfloat16_heads_beside_a_float32_target_keep_its_greedy_output(arch, kernels, one_thread):
    model = tiny_model(arch)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    heads = random_heads(model)
    heads.set_draft_vocab(list(range(0, 96, 2)) + [1, 3, 5, 7, 9, 17])  # scored over a bf16 copy of these rows
    adopt_draft_dtype(heads, "bfloat16")
    assert heads.dtype == torch.bfloat16 and model.dtype == torch.float32
    medusa_engine = Engine(model, heads=heads, tree=TREE, plan=Plan(kernels=kernels))
    for mode in ("medusa", "hybrid"):
        res = medusa_engine.generate(PROMPT, max_new_tokens=n, mode=mode)
        assert res.tokens == ref, mode
    assert heads._draft_weight.dtype == torch.bfloat16  # the draft vocabulary's rows, cached in the heads' dtype
    eagle = noisy_eagle(model)
    adopt_draft_dtype(eagle, "bfloat16")
    assert eagle.fc.weight.dtype == torch.bfloat16
    eagle_engine = Engine(model, heads=eagle, plan=Plan(kernels=kernels), proposer_config=DRAFTING)
    for mode in ("eagle", "hybrid"):
        res = eagle_engine.generate(PROMPT, max_new_tokens=n, mode=mode)
        assert res.tokens == ref, mode
    assert max(res.stats.accepted) > 1  # the bf16 head drafted tokens the target accepted


def test_bfloat16_eagle_heads_draft_what_float32_heads_mostly_draft(one_thread):
    """The same heads in bf16 rank tokens almost as in fp32: most steps propose the same tree."""
    model = tiny_model("llama")
    ref = Engine(model, heads=noisy_eagle(model), proposer_config=DRAFTING).generate(PROMPT, max_new_tokens=40, mode="eagle")
    half = noisy_eagle(model)
    adopt_draft_dtype(half, "bfloat16")
    res = Engine(model, heads=half, proposer_config=DRAFTING).generate(PROMPT, max_new_tokens=40, mode="eagle")
    assert res.tokens == ref.tokens
    assert abs(res.stats.tau - ref.stats.tau) <= 0.5 * ref.stats.tau


def test_sampling_with_bfloat16_heads_is_reproducible_and_valid(one_thread):
    model = tiny_model("llama")
    heads = random_heads(model)
    adopt_draft_dtype(heads, "bfloat16")
    eng = Engine(model, heads=heads, tree=TREE)
    a = eng.generate(PROMPT, max_new_tokens=24, mode="medusa", temperature=0.8, seed=3).tokens
    b = eng.generate(PROMPT, max_new_tokens=24, mode="medusa", temperature=0.8, seed=3).tokens
    assert a == b and len(a) == 24 and all(0 <= t < 96 for t in a)


def test_decide_draft_dtype_keeps_bfloat16_only_when_clearly_faster():
    zen5 = {"float32": 1.10, "bfloat16": 0.30}  # scoring 4 rows over 8192 x 576, AVX512_BF16
    avx2 = {"float32": 1.10, "bfloat16": 4.0}  # emulated bf16
    close = {"float32": 1.0, "bfloat16": 0.95}
    assert decide_draft_dtype(zen5)[0] == "bfloat16" and "0.30" in decide_draft_dtype(zen5)[1]
    assert decide_draft_dtype(avx2)[0] == "float32"
    assert decide_draft_dtype(close)[0] == "float32"
    assert decide_draft_dtype({"float32": 1.0})[0] == "float32"


def test_draft_dtype_pick_is_measured_once_and_cached(tmp_path):
    cache = PlanCache(tmp_path)
    model = tiny_model("llama")
    heads = random_heads(model)
    first = Planner(True, cache).draft_dtype(model, heads, None)
    (key,) = cache.entries()
    entry = cache.entries()[key]
    assert set(entry["cost_ms"]) == {"float32", "bfloat16"} and all(ms > 0 for ms in entry["cost_ms"].values())
    assert first.value == decide_draft_dtype(entry["cost_ms"])[0]
    assert key.startswith("draft_dtype | cpu ") and key.endswith("| h64 rows96")
    edited = {k: v for k, v in entry.items() if k != "busy_share"}  # a busy timing would be timed again
    cache.put(key, {**edited, "dtype": "float32" if first.value == "bfloat16" else "bfloat16"})
    again = Planner(True, cache).draft_dtype(model, heads, None)
    assert again.value != first.value and "(cached" in again.reason
    adopt_draft_dtype(heads, again.value)
    assert heads.dtype == getattr(torch, again.value)
    # a draft vocabulary is another shape: measured for its own rows
    heads.set_draft_vocab(list(range(32)))
    Planner(True, cache).draft_dtype(model, heads, None)
    assert len(cache.entries()) == 2
    # a bfloat16 target: the heads keep the target's dtype, unmeasured
    half = tiny_model("llama").to(torch.bfloat16)
    assert Planner(True, cache).draft_dtype(half, random_heads(half), None).value == "bfloat16"
    assert len(cache.entries()) == 2


def test_load_applies_the_draft_dtype_and_rejects_unknown_ones(tmp_path):
    folder = str(target_folder(tmp_path))
    eng = medusa.load(model=folder, heads="init", draft_dtype="bfloat16", kernels="default")
    assert eng.heads.dtype == torch.bfloat16 and eng.model.dtype == torch.float32
    assert eng.plan.decision("draft_dtype") == Decision("draft_dtype", "bfloat16", "asked for")
    ids = [2, 3, 4, 5, 3, 4]
    expected = hf_greedy(eng.model, ids, 12)
    assert eng.generate(ids, max_new_tokens=12, mode="hybrid").tokens == expected
    with pytest.raises(MedusaError, match="draft_dtype must be") as err:
        medusa.load(model=folder, heads="init", draft_dtype="int4", kernels="default")
    assert "\n" not in str(err.value)
    with pytest.raises(MedusaError, match="int8 is for eagle heads") as err:  # "init": Medusa heads
        medusa.load(model=folder, heads="init", draft_dtype="int8", kernels="default")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
def test_int8_eagle_heads_draft_beside_any_target_and_keep_its_greedy_output(target_dtype, one_thread):
    model = tiny_model("llama").to(target_dtype)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    bf16 = noisy_eagle(model)
    adopt_draft_dtype(bf16, "bfloat16")
    heads = noisy_eagle(model).to(torch.bfloat16)
    heads.load_state_dict(bf16.state_dict())  # the same heads, to be quantized
    vocab = list(range(0, 96, 2)) + [1, 3, 5, 7, 9, 17]
    for h in (bf16, heads):
        h.set_draft_vocab(vocab)
    state = {k: v.clone() for k, v in bf16.state_dict().items()}
    assert int8_available()
    adopt_draft_dtype(heads, "int8")
    assert heads.int8
    assert heads.int8 and heads.fc.weight.dtype == torch.bfloat16
    # the float weights stay (saving writes them), under the same names
    assert {k: v.dtype for k, v in heads.state_dict().items()} == {k: v.dtype for k, v in state.items()}
    assert all(torch.equal(heads.state_dict()[k], v) for k, v in state.items())
    # int8 products: close to the bf16 ones (per-row scales)
    feature = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = bf16.logits(feature, bf16.draft_vocab).float(), heads.logits(feature, heads.draft_vocab).float()
        assert got.shape == want.shape and not torch.equal(got, want)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()
        x = torch.randn(2, 2 * model.config.hidden_size, dtype=torch.bfloat16)
        # fc is "take the feature" plus noise: the diagonal's 1.0 sets each row's scale, so the
        # noise rounds to steps of 1/127 (measured: 2.4% of the largest output)
        assert (heads.fc(x).float() - bf16.fc(x).float()).abs().max() <= 0.05 * bf16.fc(x).float().abs().max()
    # oneDNN packs bfloat16 linears only where the CPU has them (not on an AVX2-only one)
    kernels_here = ["default"] + (["onednn"] if onednn_available("cpu", target_dtype) else [])
    for kernels in kernels_here:
        engine = Engine(model, heads=heads, plan=Plan(kernels=kernels), proposer_config=DRAFTING)  # an engine packs the target, not int8 heads
        for mode in ("eagle", "hybrid"):
            res = engine.generate(PROMPT, max_new_tokens=n, mode=mode)
            assert res.tokens == ref, (kernels, mode)
        assert max(res.stats.accepted) > 1  # the int8 head drafted tokens the target accepted
    tau = Engine(model, heads=bf16, proposer_config=DRAFTING).generate(PROMPT, max_new_tokens=n, mode="eagle").stats.tau
    assert abs(Engine(model, heads=heads, proposer_config=DRAFTING).generate(PROMPT, max_new_tokens=n, mode="eagle").stats.tau - tau) <= 0.5 * tau
