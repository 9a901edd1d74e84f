"""Packed oneDNN linears (medusa/runtime/kernels.py): the same model with other matmul kernels,
active only inside the engine's passes, picked per device by measurement and cached."""


import pytest
import torch
from test_draft import noisy_copy
from test_eagle import noisy_eagle
from tiny import DRAFTING, hf_greedy, tiny_model
from tiny_heads import random_heads

from medusa.autotune.cache import PlanCache
from medusa.autotune.device import MIN_ROWS, decide_kernels
from medusa.autotune.planner import Planner
from medusa.decoding.engine import Engine
from medusa.decoding.passes.strategies import PACKED_ROWS
from medusa.decoding.plan import Plan
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.errors import MedusaError
from medusa.runtime.exact import is_exact
from medusa.runtime.kernels import PACKING_VERSION, PackedLinears, linear_layers, onednn_available, pack, sibling_groups

PROMPT = [1, 5, 9, 12, 40, 7, 7, 3, 22, 5, 9, 17]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def stock(model: torch.nn.Module) -> bool:
    """No linear layer of ``model`` has its forward redirected."""
    return all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_this_torch_build_has_onednn_linears_on_the_cpu():
    assert onednn_available("cpu")
    assert not onednn_available("meta")


def logits_and_ops(model, ids):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(input_ids=ids).logits
    return logits, {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_packed_linears_compute_the_same_logits_and_restore_the_model(arch):
    model = tiny_model(arch)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        packed = PackedLinears(model)
        # every linear layer of the model, the tied lm_head included
        assert len(packed) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        with packed:
            assert not stock(model)
            with packed:  # nested: still packed after the inner exit
                pass
            assert not stock(model)
            first = model.lm_head.forward
        with packed:  # the same forward objects at every entry: compiled passes do not recompile
            assert model.lm_head.forward is first
        with packed:
            inside, ops = logits_and_ops(model, ids)
        after, ops_after = logits_and_ops(model, ids)
    assert stock(model)
    assert "mkldnn::_linear_pointwise" in ops and not {"aten::mm", "aten::addmm"} & ops  # oneDNN ran every linear
    assert "mkldnn::_linear_pointwise" not in ops_after
    torch.testing.assert_close(inside, before, atol=1e-5, rtol=1e-5)
    assert torch.equal(after, before)  # the stock kernels again, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_multiply_like_the_stock_ones(dtype):
    # a plain-layout oneDNN weight is repacked by every call (measured 33 vs 21 ms per pass of
    # the embedded model in bf16); the blocked one is what the kernels read
    weight = torch.randn(96, 64).to(dtype)
    if not onednn_available("cpu", dtype):  # bf16 on an AVX2-only CPU: oneDNN refuses to pack
        with pytest.raises(RuntimeError, match="bf16"):
            pack(weight)
        pytest.skip("this CPU packs no oneDNN bfloat16 weights: only their refusal was checked")
    packed = pack(weight)
    assert packed.is_mkldnn and packed.dtype == dtype and tuple(packed.shape) == (96, 64)
    x = torch.randn(5, 64).to(dtype)
    out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=tol, rtol=tol)


def test_inputs_of_more_rows_than_stock_above_run_the_stock_kernels():
    model = tiny_model("llama").to(torch.bfloat16)
    if not onednn_available("cpu", torch.bfloat16):  # an AVX2-only CPU: bf16 layers stay stock
        assert not linear_layers([model]) and linear_layers([tiny_model("llama")])  # float32 ones still pack
        pytest.skip("this CPU packs no oneDNN bfloat16 weights: only that they stay stock was checked")
    packed = PackedLinears(model, stock_above=8)
    with torch.no_grad(), packed:
        _, short = logits_and_ops(model, torch.tensor([PROMPT[:8]]))
        _, long = logits_and_ops(model, torch.tensor([PROMPT]))  # 12 rows: a prefill
    assert "mkldnn::_linear_pointwise" in short and not {"aten::mm", "aten::addmm"} & short
    assert "mkldnn::_linear_pointwise" not in long and {"aten::mm", "aten::addmm"} & long
    # the engine packs a half-precision model's decoding passes only; float32 ones everywhere
    engine = Engine(model, heads=random_heads(model), tree=TREE, plan=Plan(kernels="onednn"))
    with engine.kernel_scope():
        _, prefill = logits_and_ops(model, torch.tensor([list(range(1, PACKED_ROWS + 2))]))
        _, step = logits_and_ops(model, torch.tensor([PROMPT[:1]]))
    assert "mkldnn::_linear_pointwise" not in prefill and "mkldnn::_linear_pointwise" in step
    full = tiny_model("llama")
    with Engine(full, heads=random_heads(full), tree=TREE, plan=Plan(kernels="onednn")).kernel_scope():
        _, prefill = logits_and_ops(full, torch.tensor([list(range(1, PACKED_ROWS + 2))]))
    assert "mkldnn::_linear_pointwise" in prefill


# gemv: medusa/runtime/gemv.py (tests/test_gemv.py); "gemv>3": torch's kernels for passes of 1-3 rows, gemv above
@pytest.mark.parametrize("kernels", ["onednn", "gemv", "gemv>3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_greedy_with_packed_kernels_equals_target_greedy(arch, kernels, one_thread):
    model = tiny_model(arch)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    medusa = Engine(model, heads=random_heads(model), tree=TREE, plan=Plan(kernels=kernels), proposer_config=DRAFTING)
    for mode in ("baseline", "medusa", "lookup", "hybrid"):
        assert medusa.generate(PROMPT, max_new_tokens=n, mode=mode).tokens == ref, mode
    # a draft model: the target's own weights nudged, packed beside the target's
    draft = Engine(model, draft=noisy_copy(model, 0.02),
                   proposer_config=ProposerConfig(draft_tokens=3, draft_confidence=0.0, check_drafting=False),
                   plan=Plan(kernels=kernels))
    assert draft.generate(PROMPT, max_new_tokens=n, mode="draft").tokens == ref
    eagle = Engine(model, heads=noisy_eagle(model), plan=Plan(kernels=kernels), proposer_config=DRAFTING)
    res = eagle.generate(PROMPT, max_new_tokens=n, mode="eagle")
    assert res.tokens == ref
    assert max(res.stats.accepted) > 1  # the packed heads drafted tokens that were accepted
    assert stock(model)


def test_the_model_is_stock_between_streamed_chunks():
    # a caller holding a half-consumed stream may use the model itself meanwhile
    model = tiny_model("llama")
    eng = Engine(model, heads=random_heads(model), tree=TREE, plan=Plan(kernels="onednn"))
    stream = eng.stream(PROMPT, max_new_tokens=12, mode="medusa")
    for _ in stream:
        assert stock(model)
    assert stock(model)


@pytest.mark.parametrize("kernels", ["mkl", "gemv>", "gemv>0", "default>3", "gemv>x", "gemv>3>4"])
def test_kernel_errors_are_one_line(kernels):
    model = tiny_model("llama")
    with pytest.raises(MedusaError, match=f"unknown kernels '{kernels}'") as err:
        Engine(model, plan=Plan(kernels=kernels))
    assert "\n" not in str(err.value) and "gemv>3" in str(err.value)  # the message shows a split's spelling


# One compile in the end-to-end tier; every kernel with inductor in the peers tier (10-32 s each).
@pytest.mark.parametrize("backend, kernels", [
    pytest.param("aot_eager", "gemv", marks=pytest.mark.e2e),
    *(pytest.param(b, k, marks=pytest.mark.peers) for b, k in
      [("aot_eager", "onednn"), ("aot_eager", "gemv>3"), (True, "onednn"), (True, "gemv"), (True, "gemv>3")])])
def test_compiled_passes_run_the_packed_linears_and_stay_exact(backend, kernels, tmp_path, monkeypatch):
    """Under torch.compile each packed layer is the custom op medusa::packed_linear (inductor
    cannot lower an opaque oneDNN weight): traced, compiled, and still oneDNN (or gemv) at run time."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    torch._dynamo.reset()
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    model = tiny_model("llama")
    n = 30
    eng = Engine(model, heads=random_heads(model), tree=TREE, compile=backend, plan=Plan(kernels=kernels))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        res = eng.generate(PROMPT, max_new_tokens=n, mode="medusa")
    ops = {event.key for event in prof.key_averages()}
    assert res.tokens == hf_greedy(model, PROMPT, n)
    kernel_ran = "mkldnn::_linear_pointwise" in ops if kernels == "onednn" else \
        any(op.startswith("medusa::gemv ") for op in ops)
    assert "medusa::packed_linear" in ops and kernel_ran
    assert eng.generate(PROMPT[:-1] + [7], max_new_tokens=n, mode="hybrid").tokens == hf_greedy(model, PROMPT[:-1] + [7], n)
    assert stock(model)


def linear_calls(model, ids):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(input_ids=ids).logits
    counts = {event.key: event.count for event in prof.key_averages()}
    return logits, counts.get("mkldnn::_linear_pointwise", 0), counts.get("aten::linear", 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # qwen2: stacked biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sibling_layers_run_as_one_product_with_the_same_logits(arch, dtype):
    from medusa.runtime.kernels import FUSED_ROWS

    model = tiny_model(arch).to(dtype)
    if not onednn_available("cpu", dtype):  # an AVX2-only CPU packs no bfloat16 weights: nothing to stack
        assert not sibling_groups([model], linear_layers([model])) and PackedLinears(model).fused == 0
        pytest.skip(f"this CPU packs no oneDNN {dtype} weights: only that nothing is stacked was checked")
    layers = model.config.num_hidden_layers
    separate, stacked = PackedLinears(model, fuse=False), PackedLinears(model)
    assert stacked.fused == 5 * layers and len(stacked) == len(separate)
    for n in (1, 5, 16, FUSED_ROWS):
        ids = torch.tensor([(PROMPT * 3)[:n]])
        with torch.no_grad():
            with separate:
                ref, ref_calls, _ = linear_calls(model, ids)
            with stacked:
                out, calls, stock_calls = linear_calls(model, ids)
        assert torch.equal(out, ref), n  # bit for bit: each output is the same dot product
        assert (ref_calls, calls) == (7 * layers + 1, 4 * layers + 1), n  # q/k/v and gate/up: one product each
    # more rows than FUSED_ROWS in half precision: the stacked layers run torch's own kernels
    ids = torch.tensor([(PROMPT * 4)[:FUSED_ROWS + 1]])
    with torch.no_grad(), stacked:
        _, calls, stock_calls = linear_calls(model, ids)
    if dtype == torch.bfloat16:
        assert (calls, stock_calls) == (2 * layers + 1, 5 * layers)
    else:
        assert calls == 4 * layers + 1
    assert stock(model)


def test_a_stacked_layer_called_on_another_input_computes_its_own():
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(3, model.config.hidden_size), torch.randn(3, model.config.hidden_size)
    with torch.no_grad(), PackedLinears(model):
        q, k_other, k, k_again, v = attn.q_proj(x), attn.k_proj(y), attn.k_proj(x), attn.k_proj(x), attn.v_proj(x)
        x.mul_(2)  # changed in place after q's call: not the input q's product was made for
        q2, k2 = attn.q_proj(y), attn.k_proj(x)
    linear = torch.nn.functional.linear
    for out, layer, inp in ((q, attn.q_proj, x / 2), (k_other, attn.k_proj, y), (k, attn.k_proj, x / 2),
                            (k_again, attn.k_proj, x / 2), (v, attn.v_proj, x / 2), (q2, attn.q_proj, y),
                            (k2, attn.k_proj, x)):
        torch.testing.assert_close(out, linear(inp, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_a_layer_shared_elsewhere_is_not_stacked():
    model = tiny_model("llama")
    shared = torch.nn.Module()
    shared.proj = model.model.layers[0].self_attn.k_proj  # a second parent: its caller may not be q's
    groups = sibling_groups([model, shared], linear_layers([model, shared]))
    assert len(groups) == 2 * model.config.num_hidden_layers - 1
    assert all(model.model.layers[0].self_attn.k_proj is not layer for group in groups for layer in group)


def test_packed_weights_are_released_with_their_scope():
    import gc

    from medusa.runtime import kernels

    model = tiny_model("llama")
    gc.collect()  # engines of earlier tests that are unreachable but not yet collected
    before = len(kernels._PACKED)
    packed = PackedLinears(model)
    assert 0 < packed.fused < len(packed)  # stacked layers (q/k/v, gate/up) keep no copy of their own
    assert len(kernels._PACKED) == before + len(packed) - packed.fused
    del packed
    gc.collect()
    assert len(kernels._PACKED) == before


def test_two_scopes_over_one_model_outlive_each_other():
    # Packed copies are found by the weight itself (so a compiled graph holds no per-layer
    # key and can be saved): two engines on one model each register theirs, and releasing
    # one leaves the other's working.
    import gc

    from medusa.runtime import kernels

    model = tiny_model("llama")
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        ref = model(ids).logits
        first, second = PackedLinears(model), PackedLinears(model)
        del first
        gc.collect()
        with second:
            assert torch.allclose(model(ids).logits, ref, atol=1e-5)
        weight = model.model.layers[0].mlp.down_proj.weight
        assert len(kernels._PACKED[weight.data_ptr()]) == 1
        del second
        gc.collect()
        assert weight.data_ptr() not in kernels._PACKED


def test_decide_kernels_keeps_onednn_only_when_clearly_faster():
    zen5 = {"default": {1: 62.4, 16: 151.7}, "onednn": {1: 45.3, 16: 87.6}}
    close = {"default": {1: 50.0, 16: 60.0}, "onednn": {1: 48.0, 16: 57.0}}
    assert decide_kernels(zen5)[0] == "onednn" and "T(16)=87.6" in decide_kernels(zen5)[1]
    assert decide_kernels(close)[0] == "default"
    assert decide_kernels({"default": {1: 1.0, 16: 2.0}})[0] == "default"


def test_kernel_pick_is_measured_once_and_cached(tmp_path):
    cache = PlanCache(tmp_path)
    model = tiny_model("llama")
    first, _ = Planner(True, cache).kernels(model, None)
    (key,) = cache.entries()
    entry = cache.entries()[key]
    # float32: the gemv kernels join where they build (this machine has a C compiler: tests/test_gemv.py)
    assert set(entry["cost_ms"]) == {"default", "onednn", "gemv"} and entry["seconds"] > 0
    assert first.value == decide_kernels(probe_costs(entry))[0] and first.seconds == entry["seconds"]
    assert stock(model)  # measuring left the model as it was
    assert key.startswith("kernels | ") and key.endswith(f"| torch.float32 | onednn-p{PACKING_VERSION}".replace(
        "torch.", ""))
    # a cached entry is used as is: an edited entry wins over a new measurement
    edited = {k: v for k, v in entry.items() if k != "busy_share"}  # a busy timing would be timed again
    cache.put(key, {**edited, "kernels": "default" if first.value != "default" else "onednn"})
    again, _ = Planner(True, cache).kernels(model, None)
    assert again.value != first.value and "(cached" in again.reason and again.seconds == 0


def probe_costs(entry):
    return {k: {int(n): ms for n, ms in c.items()} for k, c in entry["cost_ms"].items()}


def test_half_precision_kernel_pick_keeps_packed_weights_only_where_exact(tmp_path):
    cache = PlanCache(tmp_path)
    half = tiny_model("llama").to(torch.bfloat16)
    choice, rows = Planner(True, cache).kernels(half, None)
    if not onednn_available("cpu", torch.bfloat16):  # an AVX2-only CPU packs no bf16 weights
        assert choice.value == "default" and "no packed oneDNN linears" in choice.reason and not cache.entries()
        pytest.skip("this CPU packs no oneDNN bfloat16 weights: only the pick's refusal was checked")
    (entry,) = cache.entries().values()
    assert set(entry["cost_ms"]) == {"default", "onednn"}
    assert not is_exact(half) and stock(half)  # measured with exact attention and packed weights, then restored
    if choice.value == "onednn":
        assert rows == entry["invariant_rows"] >= MIN_ROWS  # picked only after the exactness probe, capped by it
    else:
        assert choice.value == decide_kernels(probe_costs(entry), entry["invariant_rows"], half=True)[0]
    # faster but not exact is refused; faster and exact is kept
    faster = {"default": {1: 50.0, 16: 66.0}, "onednn": {1: 30.0, 16: 45.0}}
    assert decide_kernels(faster, MIN_ROWS - 1, half=True)[0] == "default"
    assert "not exact" in decide_kernels(faster, None, half=True)[1]
    assert decide_kernels(faster, 32, half=True) == ("onednn", decide_kernels(faster, 32, half=True)[1])
    assert "exact up to 32 rows" in decide_kernels(faster, 32, half=True)[1]


def test_int8_rows_multiply_like_their_dequantized_weights_on_any_view():
    from medusa.runtime.int8 import INT8_K_MULTIPLE, Int8Rows, int8_available, int8_linears

    assert int8_available() and not int8_available("meta")
    g = torch.Generator().manual_seed(0)
    for n, k in ((3, 16), (96, 64), (576, 576)):
        rows = Int8Rows.of(torch.randn(n, k, generator=g).to(torch.bfloat16))
        assert rows.q.dtype == torch.int8 and rows.q.abs().max() == 127
        dequantized = rows.q.float() * rows.scales.float()[:, None]
        for m in (1, 3, 5, 300):
            big = torch.randn(m + 1, k + 3, generator=g).to(torch.bfloat16)
            # a fresh input, a strided view, and a contiguous view starting off any 32-byte boundary
            for x in (big[1:, :k].contiguous(), big[1:, 3:], big.flatten()[1:1 + m * k].view(m, k)):
                want = x.float() @ dequantized.T
                got = rows.matmul(x).float()
                assert got.shape == (m, n) and (got - want).abs().max() <= 0.01 * want.abs().max(), (n, k, m)
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8Rows.of(torch.randn(4, INT8_K_MULTIPLE + 8))
    narrow = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match="got 8"):
        int8_linears(narrow)
    assert all("forward" not in layer.__dict__ for layer in narrow)  # nothing changed
    wide = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8)).to(torch.bfloat16)
    x = torch.randn(2, 32, generator=g).to(torch.bfloat16)
    want = wide(x).float()
    assert int8_linears(wide) == 2 and list(wide.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    got = wide(x).float()
    assert not torch.equal(got, want) and (got - want).abs().max() <= 0.05 * want.abs().max()
