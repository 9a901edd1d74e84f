"""The static KV cache and the compiled verification pass decode exactly like the dynamic cache."""

import os
import time

import pytest
import torch
from tiny import ARCHS, DRAFTING, hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.models.loader import init_heads_for
from medusa.runtime import hf as kv

pytestmark = pytest.mark.usefixtures("one_thread", "own_compiled_passes")


@pytest.fixture
def own_compiled_passes(tmp_path, monkeypatch):
    """A medusa cache per test: compiled passes saved by one test are not loaded by the next
    (tests that count what compiles would otherwise depend on their order)."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "medusa-cache"))

PROMPT = [5, 17, 33, 9, 41, 12]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_with_a_static_cache_equals_hf_generate(arch):
    # gemma3 mixes sliding-window and full layers: the widened masks must keep both rules
    model = tiny_model(arch, sliding_window=8) if arch in ("mistral", "gemma3") else tiny_model(arch)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, static_cache=True, proposer_config=DRAFTING)
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


@pytest.mark.e2e
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
    assert eng.passes.static and eng.passes.compiled
    first = eng.generate(PROMPT, max_new_tokens=n, mode="medusa")
    again = eng.generate(PROMPT[:-1] + [7], max_new_tokens=n, mode="medusa")  # the compiled graph, reused
    assert first.tokens == ref
    assert again.tokens == hf_greedy(model, PROMPT[:-1] + [7], n)
    # compiled kernels persist beside the cached models, for the next process
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    if backend is True:
        assert any(p.is_file() for p in (tmp_path / "inductor").rglob("*"))


@pytest.mark.peers
def test_compiled_passes_are_padded_to_a_few_buckets_and_stay_exact():
    # Modes whose proposals vary in size (lookup's chain, hybrid's tree + chain, trees cut by
    # the token budget) run padded to PASS_BUCKETS: outputs unchanged, few distinct graphs.
    from medusa.decoding.passes.strategies import PASS_BUCKETS, pad_pass, pass_bucket

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
    compiled = eng.passes.forward

    def recording(model, ids, *args, **kwargs):
        sizes.append(ids.shape[1])
        return compiled(model, ids, *args, **kwargs)

    eng.passes.forward = recording
    for prompt, n in ((PROMPT, 30), (PROMPT[:-1] + [7, 7, 7, 9], 21), ([3, 4, 5] * 4, 17)):
        ref = hf_greedy(model, prompt, n)
        for mode in ("lookup", "hybrid", "medusa"):
            assert eng.generate(prompt, max_new_tokens=n, mode=mode).tokens == ref, mode
    assert set(sizes) <= set(PASS_BUCKETS) and len(set(sizes)) <= 6, sorted(set(sizes))


@pytest.mark.peers
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_precompile_covers_every_pass_and_capacity(arch):
    # Every bucket a mode can use compiles up front; decoding afterwards, at any cache
    # capacity (a long prompt, a regrown cache), compiles nothing more and stays exact.
    from medusa.decoding.passes.strategies import PASS_BUCKETS, pass_bucket

    torch._dynamo.reset()
    kwargs = {"sliding_window": 8} if arch == "gemma3" else {}
    model = tiny_model(arch, max_position_embeddings=2048, **kwargs)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, compile="aot_eager")
    saved = eng.passes.saved  # what this process traced, what it loaded
    buckets = eng.precompile("hybrid")
    rows = len(TREE) + 1 + eng.proposer_config.chain()  # root, tree, lookup chain
    least = pass_bucket(len(TREE) + 1)  # the whole tree without a chain: smaller passes pad up to it
    assert buckets == [b for b in PASS_BUCKETS if least <= b < rows] + [pass_bucket(rows)]
    assert saved.traced == buckets and saved.loaded == []
    assert eng.precompile("hybrid") == buckets and saved.traced == buckets  # already compiled
    chains = eng.precompile("lookup")  # lookup (and baseline): every size from the root alone
    assert chains == [b for b in PASS_BUCKETS if b <= pass_bucket(1 + eng.proposer_config.chain())]
    buckets = sorted(set(buckets) | set(chains))
    assert sorted(saved.traced) == buckets
    capacities = set()
    for prompt, n in ((PROMPT, 40), ([3, 4, 5, 6] * 80, 30), (PROMPT[:-1] + [7, 7, 7, 9], 300)):
        for mode in ("baseline", "lookup", "hybrid", "medusa"):
            res = eng.generate(prompt, max_new_tokens=n, mode=mode)
            assert res.tokens == hf_greedy(model, prompt, n), (mode, len(prompt))
            capacities.add(kv.capacity(res.state.cache))
    assert len(capacities) >= 2  # 512 and 1024 slots: both served by the precompiled graphs
    assert sorted(saved.traced) == buckets and saved.fallback is None  # no new graph, no per-process tracing


@pytest.mark.e2e
def test_without_precompile_each_pass_size_compiles_once_whatever_the_capacity():
    torch._dynamo.reset()
    model = tiny_model("qwen2", max_position_embeddings=2048)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, compile="aot_eager")
    sizes, compiled = set(), eng.passes.forward

    def recording(model, ids, *args, **kwargs):
        sizes.add(ids.shape[1])
        return compiled(model, ids, *args, **kwargs)

    eng.passes.forward = recording
    capacities = set()
    for prompt in (PROMPT, [3, 4, 5, 6] * 80, [9, 8] * 250):  # 256, 512 and 1024 slots
        res = eng.generate(prompt, max_new_tokens=24, mode="medusa")
        assert res.tokens == hf_greedy(model, prompt, 24)
        capacities.add(kv.capacity(res.state.cache))
    assert len(capacities) == 3
    assert sorted(compiled.traced) == sorted(sizes) and compiled.fallback is None


@pytest.mark.peers
def test_a_compiled_cpu_cache_grows_by_slot_steps_across_chat_turns():
    # A CPU-compiled engine reserves the prompt plus SLOT_STEP slots and grows SLOT_STEP at a
    # time (attention reads every slot); a reused state keeps growing; tokens stay exact.
    from medusa.decoding.passes.strategies import SLOT_STEP

    torch._dynamo.reset()
    model = tiny_model("llama", max_position_embeddings=2048)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, compile="aot_eager")
    prompt = [3, 4, 5, 6] * 70  # 280 tokens
    first = eng.generate(prompt, max_new_tokens=100, mode="hybrid")
    assert first.tokens == hf_greedy(model, prompt, 100)
    cap = kv.capacity(first.state.cache)
    assert cap % SLOT_STEP == 0 and len(prompt) + 100 <= cap < len(prompt) + 100 + SLOT_STEP + 16  # not 512
    follow = prompt + first.tokens + [7, 8, 9]
    second = eng.generate(follow, max_new_tokens=90, mode="hybrid", state=first.state)
    assert second.tokens == hf_greedy(model, follow, 90)
    assert kv.capacity(second.state.cache) % SLOT_STEP == 0 and kv.capacity(second.state.cache) > cap


@pytest.mark.peers
def test_precompile_rows_come_from_the_proposer():
    model = tiny_model("llama")
    heads = init_heads_for(model, num_heads=3)
    eng = Engine(model, heads=heads, tree=TREE, compile="aot_eager")
    assert eng.proposer("baseline").max_rows == 1
    assert eng.proposer("medusa").max_rows == len(TREE) + 1
    assert eng.proposer("lookup").max_rows == 1 + eng.proposer_config.chain()
    assert eng.proposer("hybrid").max_rows == len(TREE) + 1 + eng.proposer_config.chain()
    # the smallest proposal but for a budget cut: a compiled pass pads smaller ones up to it
    assert [eng.proposer(m).min_rows for m in ("baseline", "medusa", "lookup", "hybrid")] == [1, 7, 1, 7]
    assert Engine(model, heads=heads, tree=TREE).precompile("hybrid") == []  # nothing to compile eagerly

    class Silent:  # a user's proposer that does not say how large it gets
        def begin(self, state): ...
        def propose(self, state): ...
        def update(self, state, outcome): ...

    with pytest.raises(MedusaError, match="max_rows"):
        eng.precompile(Silent())
    torch._dynamo.reset()
    assert eng.precompile(Silent(), rows=3) == [1, 2, 4]


@pytest.mark.peers
def test_a_tree_cut_short_by_the_budget_pads_up_to_the_precompiled_sizes():
    # precompile("hybrid") compiles from the whole tree's size up; steps near the end of an
    # answer, whose tree the token budget cuts to 1-3 rows, run padded into those graphs:
    # nothing compiles during the answers, and the tokens stay exact.
    from medusa.decoding.passes.strategies import pass_bucket

    torch._dynamo.reset()
    model = tiny_model("llama", max_position_embeddings=2048)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, compile="aot_eager")
    buckets = eng.precompile("hybrid")
    assert buckets[0] == pass_bucket(len(TREE) + 1) > 1
    sizes, compiled = [], eng.passes.forward

    def recording(model, ids, *args, **kwargs):
        sizes.append(ids.shape[1])
        return compiled(model, ids, *args, **kwargs)

    eng.passes.forward = recording
    for prompt, n in ((PROMPT, 1), (PROMPT, 2), (PROMPT[:-1] + [7, 7, 7, 9], 3), ([3, 4, 5] * 4, 13)):
        assert eng.generate(prompt, max_new_tokens=n, mode="hybrid").tokens == hf_greedy(model, prompt, n)
    assert sizes and set(sizes) <= set(buckets)  # budget-cut trees included (n = 2, 3)
    assert compiled.traced == buckets
    eng.generate(PROMPT, max_new_tokens=4, mode="baseline")  # another mode's sizes still compile on use
    assert 1 in sizes and compiled.traced == buckets + [1] and compiled.fallback is None


def test_a_compile_cache_folder_the_user_chose_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    kv.persist_compiled(tmp_path / "medusa")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    kv.persist_compiled(tmp_path / "medusa")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "medusa")


@pytest.mark.peers
def test_the_bench_runs_compiled_modes_beside_eager_ones(tmp_path):
    # MODE+compile: the same mode on a compiled twin engine, in the same run; its pass sizes
    # compile before the timing and the seconds are reported.
    import json

    from train_fixtures import tiny_target

    from infer import bench

    torch._dynamo.reset()
    out = tmp_path / "bench.json"
    args = ["--model", str(tiny_target(tmp_path / "model")), "--limit", "2", "--max-new-tokens", "10",
            "--lookup-tokens", "2", "--modes", "hf,lookup,lookup+compile", "--json", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert set(modes) == {"hf", "lookup", "lookup+compile"}
    for name in ("lookup", "lookup+compile"):
        assert modes[name]["identical"] == 2, name
    assert set(result["meta"]["compile_seconds"]) == {"lookup+compile"}
    assert bench.main(["--model", str(tmp_path / "model"), "--modes", "hf+compile"]) == 1  # not an engine mode


@pytest.mark.e2e
def test_a_second_engine_loads_the_saved_passes_instead_of_tracing(tmp_path):
    # Each pass size is compiled ahead of time and saved (medusa/decoding/passes/saved.py); an
    # engine for a model of the same architecture and config loads them: nothing is traced,
    # its own weights are read at each pass, any capacity works, and the tokens stay exact.
    first = tiny_model("llama", max_position_embeddings=2048)
    eng = Engine(first, heads=init_heads_for(first, num_heads=3), tree=TREE, compile="aot_eager")
    buckets = eng.precompile("hybrid")
    assert eng.passes.saved.traced == buckets and eng.passes.saved.loaded == []
    saved = sorted(p.name for p in (tmp_path / "medusa-cache" / "compiled").iterdir())
    assert saved == sorted(eng.passes.saved.path(b).name for b in buckets)

    other = tiny_model("llama", seed=3, max_position_embeddings=2048)  # other weights, same config
    again = Engine(other, heads=init_heads_for(other, num_heads=3), tree=TREE, compile="aot_eager")
    assert again.passes.saved.key == eng.passes.saved.key
    assert again.precompile("hybrid") == buckets
    assert again.passes.saved.loaded == buckets and again.passes.saved.traced == []
    for prompt, n in ((PROMPT, 40), ([3, 4, 5, 6] * 80, 30)):  # 256 and 512 slots
        assert again.generate(prompt, max_new_tokens=n, mode="hybrid").tokens == hf_greedy(other, prompt, n)
    assert again.passes.saved.traced == [] and again.passes.saved.fallback is None


def test_saved_passes_are_keyed_by_what_the_graph_bakes_in():
    from medusa.decoding.passes.saved import fingerprint

    llama = fingerprint(tiny_model("llama"), "default", "inductor")
    assert fingerprint(tiny_model("llama", seed=5), "default", "inductor") == llama  # weights are inputs
    assert fingerprint(tiny_model("llama", hidden_size=32), "default", "inductor") != llama
    assert fingerprint(tiny_model("qwen2"), "default", "inductor") != llama
    assert fingerprint(tiny_model("llama"), "onednn", "inductor") != llama
    assert fingerprint(tiny_model("llama"), "default", "aot_eager") != llama


@pytest.mark.e2e
def test_an_unreadable_saved_pass_is_compiled_again_with_a_warning():
    model = tiny_model("llama")
    eng = Engine(model, compile="aot_eager")
    assert eng.precompile("baseline") == [1]
    eng.passes.saved.path(1).write_bytes(b"not a compiled graph")
    fresh = Engine(model, compile="aot_eager")
    with pytest.warns(RuntimeWarning, match="could not be loaded"):
        fresh.precompile("baseline")
    assert fresh.passes.saved.traced == [1] and fresh.passes.saved.fallback is None
    assert fresh.generate(PROMPT, max_new_tokens=12, mode="baseline").tokens == hf_greedy(model, PROMPT, 12)
    third = Engine(model, compile="aot_eager")  # the file was written again, whole
    third.precompile("baseline")
    assert third.passes.saved.loaded == [1]


@pytest.mark.e2e
def test_saved_passes_nobody_loaded_for_a_month_are_pruned_when_another_is_saved():
    import time

    model = tiny_model("llama")
    eng = Engine(model, compile="aot_eager")
    eng.precompile("baseline")
    folder, used = eng.passes.saved.folder, eng.passes.saved.path(1)
    month_ago = time.time() - 40 * 86400
    stale, recent, other = folder / "pass-0123-t1-1.bin", folder / "pass-4567-t1-8.bin", folder / "notes.txt"
    for file in (stale, recent, other):
        file.write_bytes(b"x")
    for file, age in ((stale, month_ago), (recent, time.time() - 10 * 86400), (other, month_ago), (used, month_ago)):
        os.utime(file, (age, age))
    again = Engine(model, compile="aot_eager")
    again.precompile("baseline")  # loads the month-old file: it is in use again
    assert again.passes.saved.loaded == [1] and used.stat().st_mtime > time.time() - 3600
    wider = tiny_model("llama", hidden_size=32)
    Engine(wider, compile="aot_eager").precompile("baseline")  # a new file saved: the folder is pruned
    assert not stale.exists()
    assert used.exists() and recent.exists() and other.exists()
    assert len(list(folder.glob("pass-*.bin"))) == 3


@pytest.mark.peers
def test_a_pass_that_breaks_the_graph_falls_back_to_tracing_with_a_warning():
    # A saved pass must be one graph; a model whose forward breaks it (here a real dynamo
    # graph break in a layer) keeps decoding exactly through per-process tracing.
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    stock = mlp.forward

    def breaking(x):
        torch._dynamo.graph_break()
        return stock(x)

    mlp.forward = breaking
    ref = hf_greedy(model, PROMPT, 20)
    torch._dynamo.reset()
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, compile="aot_eager")
    with pytest.warns(RuntimeWarning, match="could not be compiled as one saved graph"):
        res = eng.generate(PROMPT, max_new_tokens=20, mode="hybrid")
    assert res.tokens == ref
    assert eng.passes.saved.fallback and eng.passes.saved.traced == []
    assert eng.generate(PROMPT[:-1] + [7], max_new_tokens=20, mode="medusa").tokens == hf_greedy(model, PROMPT[:-1] + [7], 20)


@pytest.mark.peers
def test_a_new_process_decodes_with_the_inductor_pass_a_first_one_saved(tmp_path):
    # The real thing: inductor's C++ kernels compiled and saved by this process, loaded by a
    # fresh Python process that traces nothing and decodes the same tokens.
    import subprocess
    import sys
    from pathlib import Path

    model = tiny_model("llama")
    eng = Engine(model, compile=True)
    assert eng.precompile("baseline") == [1] and eng.passes.saved.traced == [1]
    ref = hf_greedy(model, PROMPT, 16)
    assert eng.generate(PROMPT, max_new_tokens=16, mode="baseline").tokens == ref
    script = (  # the same thread count: inductor's CPU kernels bake it in, so it keys the saved pass
        f"import torch; torch.set_num_threads({torch.get_num_threads()})\n"
        "from tiny import tiny_model\n"
        "from medusa.decoding.engine import Engine\n"
        "eng = Engine(tiny_model('llama'), compile=True)\n"
        "eng.precompile('baseline')\n"
        f"tokens = eng.generate({PROMPT}, max_new_tokens=16, mode='baseline').tokens\n"
        "print(eng.passes.saved.loaded, eng.passes.saved.traced, eng.passes.saved.fallback, tokens)\n"
    )
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"[1] [] None {ref}"


@pytest.mark.e2e
def test_a_pass_that_cannot_be_saved_is_still_used_with_a_warning(tmp_path):
    (tmp_path / "medusa-cache").mkdir()
    (tmp_path / "medusa-cache" / "compiled").write_text("a file where the folder should be")
    model = tiny_model("llama")
    eng = Engine(model, compile="aot_eager")
    with pytest.warns(RuntimeWarning, match="could not be saved"):
        assert eng.precompile("baseline") == [1]
    assert eng.passes.saved.traced == [1] and eng.passes.saved.fallback is None
    assert eng.generate(PROMPT, max_new_tokens=12, mode="baseline").tokens == hf_greedy(model, PROMPT, 12)


@pytest.mark.peers
def test_passes_compiled_after_the_same_random_seed_stay_apart():
    # Torch keys the cache entry of a graph it cannot hash (ours, with opaque ops) by a nonce from
    # Python's `random`: after the same seed (transformers' set_seed, a training script) two
    # different graphs drew the same key, and the second pass failed on the first's entry
    # (KeyError on a shape symbol) or could load it. Each compile now stays apart, exact, and
    # leaves the user's random stream where it was.
    import random

    for arch in ("llama", "qwen2"):
        model = tiny_model(arch, num_hidden_layers=3 if arch == "qwen2" else 2)
        random.seed(0)
        eng = Engine(model, compile=True)
        assert eng.precompile("baseline") == [1]
        assert eng.passes.saved.fallback is None and eng.passes.saved.traced == [1]
        after = random.random()
        random.seed(0)
        assert after == random.random()
        assert eng.generate(PROMPT, max_new_tokens=12, mode="baseline").tokens == hf_greedy(model, PROMPT, 12)


def test_the_single_use_entries_saved_passes_leave_are_pruned_after_a_day(tmp_path, monkeypatch):
    from medusa.decoding.passes.saved import prune_nonces

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    entries = {}
    for key, age_days in (("0.5817", 2), ("0.9921", 0), ("a6dkmnjwoatib7l7", 2)):  # nonces, then a real key
        (tmp_path / "aotautograd" / key).mkdir(parents=True)
        entries[key] = tmp_path / "aotautograd" / key / "entry"
        entries[key].write_bytes(b"graph")
        os.utime(entries[key], (time.time() - age_days * 86400,) * 2)
    assert prune_nonces() == [entries["0.5817"]]
    assert [k for k, f in entries.items() if f.exists()] == ["0.9921", "a6dkmnjwoatib7l7"]
