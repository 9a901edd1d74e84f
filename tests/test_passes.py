"""Pass strategies (medusa/decoding/passes/strategies.py): each decodes what eager passes decode, the
factory picks the right one, ``compile="auto"`` picks per generation, and the background build
builds what is missing.

CUDA graphs need CUDA: ``test_cuda_graphs_decode_what_eager_passes_decode`` runs where there is
one and skips visibly elsewhere; without it their strategy's own steps (capacity marked dynamic,
outputs cloned, powers-of-two growth) are checked on the CPU through another torch.compile backend."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from tiny import hf_greedy, tiny_model
from tiny_heads import random_heads

from medusa.decoding.engine import Engine
from medusa.decoding.passes import saved as compiled
from medusa.decoding.passes.saved import SavedPasses
from medusa.decoding.passes.strategies import (
    SLOT_STEP,
    AutoPasses,
    PassStrategy,
    SavedGraphPasses,
    StaticPasses,
    TracedPasses,
    make_passes,
)
from medusa.errors import MedusaError
from medusa.runtime import hf as kv
from medusa.runtime.exact import use_exact

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

PROMPT = [5, 17, 33, 9, 41, 12, 5, 17, 33]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
MODES = ("baseline", "medusa", "lookup", "lookahead")  # lookahead: side rows in the pass


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A medusa cache per test (saved passes of one test are not loaded by the next), and
    inductor's cache variable restored after the factory sets it."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "medusa-cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))
    return tmp_path / "medusa-cache"


def decode(eng: Engine, prompt: list[int], n: int = 24) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Per mode: the greedy tokens and the last pass's logits row."""
    out = {}
    for mode in MODES:
        res = eng.generate(prompt, max_new_tokens=n, mode=mode)
        out[mode] = (res.tokens, res.state.logits)
    return out


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.e2e),
                                  pytest.param("qwen2", marks=pytest.mark.peers)])
def test_every_strategy_decodes_what_eager_passes_decode(arch):
    torch._dynamo.reset()
    model = tiny_model(arch)
    heads = random_heads(model)
    ref = hf_greedy(model, PROMPT, 24)
    eager = Engine(model, heads=heads, tree=TREE)
    static = Engine(model, heads=heads, tree=TREE, static_cache=True)
    saved = Engine(model, heads=heads, tree=TREE, compile="aot_eager")
    traced = Engine(model, heads=heads, tree=TREE)
    traced.passes = TracedPasses(model, "aot_eager", "per-process tracing, as CUDA graphs run")
    assert [e.passes.name for e in (eager, static, saved, traced)] == ["eager", "static", "saved-graphs", "traced"]
    runs = {e.passes.name: decode(e, PROMPT) for e in (eager, static, saved, traced)}
    for name, run in runs.items():
        for mode in MODES:
            assert run[mode][0] == ref, (name, mode)
            # float32 rows round differently with a cache's shape and a backend's decompositions
            # (bit-identical compiled passes: exact ones, tests/test_compiled_exact.py)
            torch.testing.assert_close(run[mode][1], runs["eager"][mode][1], rtol=1e-5, atol=1e-5)


def test_the_factory_picks_the_strategy_per_compile_and_static_cache():
    model = tiny_model("llama")
    cases = {(False, False): PassStrategy, (False, True): StaticPasses, (True, False): SavedGraphPasses,
             (True, True): SavedGraphPasses, ("aot_eager", False): SavedGraphPasses, ("auto", False): AutoPasses,
             ("auto", True): AutoPasses}
    for (compile, static), kind in cases.items():
        passes = make_passes(model, compile, static)
        assert type(passes) is kind, (compile, static)
        assert passes.compiled == bool(compile) and passes.static == (kind in (StaticPasses, SavedGraphPasses))
    saved = make_passes(model, "aot_eager")
    assert saved.saved.backend == "aot_eager" and saved.saved.build and saved.slot_step == SLOT_STEP
    auto = make_passes(model, "auto")
    assert auto.saved.backend == "inductor" and not auto.saved.build  # auto never compiles in the process
    assert make_passes(model, False).saved is None and make_passes(model, False).reason == "compile=False"


def test_the_factory_off_the_cpu_traces_passes_and_auto_stays_eager():
    # The meta device stands in for a GPU: compile=True traces in each process (CUDA graphs on
    # CUDA), "auto" is eager there and says why, exact attention refuses compiled passes.
    model = tiny_model("llama").to("meta")
    traced = make_passes(model, True)
    assert type(traced) is TracedPasses and traced.static and traced.compiled and traced.slot_step is None
    auto = make_passes(model, "auto", static_cache=True)
    assert type(auto) is StaticPasses and "eager on meta" in auto.reason
    assert type(make_passes(model, "auto")) is PassStrategy
    with pytest.raises(MedusaError, match="runs on the CPU only"):
        use_exact(model, True, True)
    assert use_exact(model, True, False)  # eager exact passes run anywhere


def test_auto_with_norms_it_cannot_make_opaque_stays_eager_and_says_why():
    gemma = tiny_model("gemma3").to(torch.bfloat16)
    eng = Engine(gemma, compile="auto")
    assert eng.exact and eng.passes.name == "eager" and "Gemma3RMSNorm" in eng.passes.reason


def test_traced_passes_mark_the_capacity_clone_their_outputs_and_grow_in_powers_of_two():
    torch._dynamo.reset()
    model = tiny_model("llama", max_position_embeddings=2048)
    eng = Engine(model, heads=random_heads(model), tree=TREE)
    eng.passes = traced = TracedPasses(model, "aot_eager", "test")
    returned, marked = [], []
    inner = traced.forward

    def watched(model, ids, positions, cache, mask, **kwargs):
        marked.append(hasattr(cache.layers[0].keys, "_dynamo_dynamic_indices"))
        logits, hidden = inner(model, ids, positions, cache, mask, **kwargs)
        returned.append(logits)
        return logits, hidden

    traced.forward = watched
    prompt = [3, 4, 5, 6] * 70  # 280 tokens
    res = eng.generate(prompt, max_new_tokens=40, mode="medusa")
    assert res.tokens == hf_greedy(model, prompt, 40)
    assert kv.capacity(res.state.cache) == 512  # a power of two, not a multiple of SLOT_STEP
    assert all(marked) and marked
    last = returned[-1]
    assert res.state.logits.untyped_storage().data_ptr() != last.untyped_storage().data_ptr()  # a copy


def test_auto_runs_a_generation_eagerly_until_every_size_it_needs_is_saved(own_cache, monkeypatch):
    # AutoPasses over saved graphs of a backend that compiles in seconds: a generation whose
    # sizes are not all saved runs eagerly on a dynamic cache; once another engine saves them,
    # the next generation runs the saved graphs on a static cache, with the same tokens.
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "RECHECK_S", 0.0)
    model = tiny_model("llama")
    ref = hf_greedy(model, PROMPT, 16)
    eng = Engine(model)
    graphs = SavedGraphPasses(model, SavedPasses(model, own_cache / "compiled", "aot_eager", build=False), "test")
    eng.passes = AutoPasses(model, graphs, "test")
    assert eng.unsaved_passes("baseline") == [1]
    first = eng.generate(PROMPT, max_new_tokens=16, mode="baseline")
    assert first.tokens == ref and not kv.is_static(first.state.cache)
    assert Engine(model, compile="aot_eager").precompile("baseline") == [1]  # saved by another engine
    assert eng.unsaved_passes("baseline") == []
    second = eng.generate(PROMPT, max_new_tokens=16, mode="baseline")
    assert second.tokens == ref and kv.is_static(second.state.cache)
    assert graphs.saved.loaded == [1] and graphs.saved.traced == []
    # a generation that needs a size not saved (medusa's tree) stays eager
    medusa = Engine(model, heads=random_heads(model), tree=TREE)
    medusa.passes = AutoPasses(model, graphs, "test")
    res = medusa.generate(PROMPT, max_new_tokens=16, mode="medusa")
    assert res.tokens == ref and not kv.is_static(res.state.cache)


def test_engines_whose_passes_save_nothing_build_nothing():
    build = Engine(tiny_model("llama")).build_passes("baseline")
    assert build.sizes == [] and build.missing == [] and build.pid is None and build.wait() is None


def test_a_background_build_needs_a_target_it_can_load():
    eng = Engine(tiny_model("llama"), compile="auto")  # built from a config: no folder to load from
    with pytest.raises(MedusaError, match="source="):
        eng.build_passes("baseline")


@pytest.mark.peers
def test_build_passes_builds_the_missing_sizes_in_a_background_process(tmp_path, monkeypatch):
    from train_fixtures import tiny_target

    from medusa.models.target import load_target

    monkeypatch.setattr(compiled, "RECHECK_S", 0.0)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))  # the child imports this tree
    folder = tiny_target(tmp_path / "target")
    model = load_target(str(folder), device="cpu", dtype="float32")[0]
    prompt = [t % model.config.vocab_size for t in PROMPT]
    ref = hf_greedy(model, prompt, 12)
    eng = Engine(model, compile="auto")
    build = eng.build_passes("baseline")
    assert build.sizes == [1] and build.missing == [1] and build.loaded == [] and build.started
    assert build.wait(timeout=600) == 0, build.log.read_text()[-2000:]
    assert "saved 1 pass size" in build.log.read_text()
    assert eng.unsaved_passes("baseline") == []
    res = eng.generate(prompt, max_new_tokens=12, mode="baseline")
    assert res.tokens == ref and kv.is_static(res.state.cache) and eng.passes.saved.loaded == [1]
    again = eng.build_passes("baseline")  # all saved: loaded, nothing started
    assert again.loaded == [1] and again.missing == [] and not again.started


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_graphs_decode_what_eager_passes_decode(arch):
    torch._dynamo.reset()
    model = tiny_model(arch)
    heads = random_heads(model)
    model.to("cuda")
    heads.to("cuda")
    eager = Engine(model, heads=heads, tree=TREE)
    graphs = Engine(model, heads=heads, tree=TREE, compile=True)
    assert graphs.passes.name == "cuda-graphs"
    graphs.precompile("medusa")
    ref, got = decode(eager, PROMPT), decode(graphs, PROMPT)
    for mode in MODES:
        assert got[mode][0] == ref[mode][0], mode
        torch.testing.assert_close(got[mode][1], ref[mode][1], rtol=1e-4, atol=1e-4)
