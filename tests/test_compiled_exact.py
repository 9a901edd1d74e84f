"""Compiled exact passes (docs/compile.md#compiled-exact-passes): on the CPU a compiled half-precision
pass is bit-identical to the eager one, so compiled speculation keeps every token of eager
baseline decoding. Attention, the norms' mean of squares and the rotary embedding run as
opaque ops (medusa/runtime/exact.py), the rest with inductor's emulated precision casts;
stacked linear products stay one call per group (kernels.MergeStacked)."""

from __future__ import annotations

import pytest
import torch
from test_engine import random_heads
from test_exact import PATHS, PREFIX
from tiny import tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.decoding.tree import compile_tree
from medusa.errors import MedusaError
from medusa.runtime import hf as kv
from medusa.runtime.exact import set_exact
from medusa.runtime.kernels import MergeStacked, onednn_available
from medusa.runtime.opaque import OpaqueRMSNorm, OpaqueRotary, opaque_ops

# compiles passes or launches processes: make test-all only (the fast tier skips it)
pytestmark = pytest.mark.peers

PROMPT = [5, 17, 33, 9, 41, 12, 5, 17, 33]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "medusa-cache"))
    return tmp_path / "medusa-cache"


def _kernels() -> str:
    return "onednn" if onednn_available("cpu", torch.bfloat16) else "default"


def _logits(model, run, width: int, kernels) -> list[torch.Tensor]:
    """Logits of a prompt pass, then a tree pass and a one-token pass on a static cache, each
    pass through ``run`` (kv.forward, or a compiled pass)."""
    cpu, dtype = torch.device("cpu"), model.dtype
    with torch.inference_mode(), kernels:  # inputs made inside too: the engine's are inference tensors
        tree = compile_tree(PATHS)
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(3, 96, (1, PREFIX), generator=g)
        tokens = torch.randint(3, 96, (tree.num_nodes,), generator=g)
        cache = kv.new_static_cache(model, width)
        kv.forward(model, prompt, torch.arange(PREFIX)[None], cache, kv.causal_mask(model, 0, PREFIX, dtype, cpu, width))
        mask = kv.tree_attention_mask(model, PREFIX, tree.ancestor, tree.depth, dtype, width)
        tree_logits, _ = run(model, tokens[None], (PREFIX + tree.depth)[None], cache, mask)
        n = PREFIX + tree.num_nodes
        one, _ = run(model, tokens[:1, None], torch.tensor([[n]]), cache, kv.causal_mask(model, n, 1, dtype, cpu, width))
    return [tree_logits.clone(), one.clone()]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_compiled_bfloat16_pass_is_bit_identical_to_the_eager_one(arch, cache):
    model = tiny_model(arch).to(torch.bfloat16)
    eng = Engine(model, compile=True, plan=Plan(kernels=_kernels()))
    assert eng.exact and eng.passes.name == "saved-graphs"
    width = PREFIX + 64
    eager = _logits(model, kv.forward, width, eng.kernel_scope())
    compiled = _logits(model, eng.passes.forward, width, eng.kernel_scope())
    assert sorted(eng.passes.saved.traced) == sorted({len(PATHS) + 1, 1})  # both sizes ran compiled
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_compiled_bfloat16_speculation_equals_eager_baseline(arch, cache):
    model = tiny_model(arch).to(torch.bfloat16)
    heads = random_heads(model, 0).to(torch.bfloat16)
    kernels = _kernels()
    base = Engine(model, plan=Plan(kernels=kernels)).generate(PROMPT, max_new_tokens=32, mode="baseline")
    eng = Engine(model, heads=heads, tree=PATHS, compile=True, plan=Plan(kernels=kernels))
    eng.precompile("medusa")
    for mode in ("baseline", "medusa", "hybrid", "lookup"):
        out = eng.generate(PROMPT, max_new_tokens=32, mode=mode)
        assert out.tokens == base.tokens, mode
        if mode != "baseline":
            assert out.stats.steps < base.stats.steps, mode  # it did speculate and accept


def test_opaque_modules_compute_what_they_replace():
    model = tiny_model("llama").to(torch.bfloat16)
    set_exact(model, True)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        replaced = opaque_ops(model)
        after = model(input_ids=ids).logits
    norms = [m for m in model.modules() if isinstance(m, OpaqueRMSNorm)]
    layers = model.config.num_hidden_layers
    assert len(norms) == 2 * layers + 1 and sum(isinstance(m, OpaqueRotary) for m in model.modules()) == 1
    assert replaced == len(norms) + 1 and opaque_ops(model) == replaced  # a second call replaces nothing
    assert torch.equal(before, after)
    assert norms[0].weight is model.model.layers[0].input_layernorm.weight  # the same parameter, not a copy
    assert set(model.state_dict()) == set(tiny_model("llama").state_dict())  # checkpoints keep their names


def test_the_opaque_rotary_compiles_to_eager_cos_and_sin_at_every_position():
    model = tiny_model("llama")
    opaque_ops(model)
    rotary = model.model.rotary_emb
    positions = torch.arange(4096)[None]
    x = torch.zeros(1, dtype=torch.bfloat16)
    compiled = torch.compile(lambda x, p: rotary(x, p), dynamic=False, options={"emulate_precision_casts": True})
    with torch.inference_mode():
        for got, want in zip(compiled(x, positions), rotary.rotary(x, positions)):
            assert torch.equal(got, want)


def test_norms_of_another_form_refuse_compiled_exact_passes_in_one_line(cache):
    gemma = tiny_model("gemma3").to(torch.bfloat16)  # Gemma's norm scales by 1 + weight
    with pytest.raises(MedusaError, match="Gemma3RMSNorm is another form.*dtype='float32'") as err:
        Engine(gemma, compile=True)
    assert "\n" not in str(err.value)
    auto = Engine(gemma, compile="auto")  # the chat's default: eager, and it says why
    assert auto.passes.name == "eager" and "Gemma3RMSNorm" in auto.passes.reason
    assert Engine(gemma, compile="aot_eager", plan=Plan(exact=False)).passes.compiled  # the caller's explicit opt-out


def test_merge_stacked_keeps_one_call_per_group():
    op = torch.ops.medusa.stacked_linear.default
    graph = torch.fx.Graph()
    x, w, v = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("v")
    calls = [graph.call_function(op, (x, w, 12)) for _ in range(3)] + [graph.call_function(op, (x, v, 12))]
    parts = [graph.call_function(torch.ops.aten.slice.Tensor, (c, -1, 0, 4)) for c in calls]
    graph.output(tuple(parts))
    MergeStacked()(graph)
    kept = [n for n in graph.nodes if n.target is op]
    assert [n.args[1] for n in kept] == [w, v]  # one call per (input, group); other groups stay
    assert all(p.args[0] in kept for p in parts)
    assert MergeStacked().uuid() == MergeStacked().uuid()
