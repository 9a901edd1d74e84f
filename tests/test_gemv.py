"""The gemv kernels (medusa/runtime/gemv.py, gemv.c): built here with the real C compiler,
products like torch's, rows independent of the row count, a damaged library rebuilt, no
compiler a one-line reason. Engines on them, eager and compiled, greedy-identical to
``generate``: tests/test_kernels.py (parametrized over the packed kernels)."""

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from medusa.autotune import device as probes
from medusa.autotune.cache import PlanCache
from medusa.autotune.device import decide_kernels
from medusa.autotune.planner import Planner
from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.errors import MedusaError
from medusa.runtime import gemv
from medusa.runtime.kernels import PackedLinears, linear_layers, sibling_groups

PROMPT = [1, 5, 9, 12, 40, 7, 7, 3, 22, 5, 9, 17]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """The kernels built into an empty cache (and the process's library forgotten after)."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    gemv.library.cache_clear()
    yield tmp_path
    gemv.library.cache_clear()


def test_products_match_torch_and_each_row_is_its_one_row_product():
    g = torch.Generator().manual_seed(0)
    # output and input sizes off the kernel's blocks (16 or 8 lanes, chunks of 64 inputs)
    for out_features, in_features in ((1, 1), (7, 5), (1003, 577), (64, 128), (100, 1536)):
        weight = torch.randn(out_features, in_features, generator=g)
        bias = torch.randn(out_features, generator=g)
        packed = gemv.pack(weight)
        x = torch.randn(40, in_features, generator=g)
        ones = torch.cat([gemv.product(x[i:i + 1], packed, out_features) for i in range(40)])
        for n in (1, 2, 3, 4, 5, 7, 8, 13, 17, 40):
            got = gemv.product(x[:n], packed, out_features)
            torch.testing.assert_close(got, x[:n] @ weight.T, atol=2e-5 * in_features ** 0.5, rtol=1e-5)
            assert torch.equal(got, ones[:n]), (out_features, in_features, n)  # bitwise, whatever n
        with_bias = gemv.product(x[:3], packed, out_features, bias)
        assert torch.equal(with_bias, ones[:3] + bias)
    # batch dimensions are kept, an empty input is an empty output
    packed = gemv.pack(weight)
    assert gemv.product(x[:6].reshape(2, 3, -1), packed, 100).shape == (2, 3, 100)
    assert gemv.product(x[:0], packed, 100).shape == (0, 100)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):
        gemv.pack(weight.to(torch.float16))
    with pytest.raises(ValueError, match="does not fit a packed weight"):  # never a read past the weight
        gemv.product(torch.randn(2, 1537), packed, 100)


def test_bfloat16_weights_multiply_in_float32_at_half_the_bytes():
    """Draft heads in bfloat16 beside a float32 target: their packed copy keeps the bfloat16
    values (half the bytes to read), each widened exactly, the products summed in float32 as for
    a float32 weight: the product of the widened weight bitwise, rounded to the input's dtype."""
    g = torch.Generator().manual_seed(1)
    for out_features, in_features in ((7, 5), (1003, 577), (8192, 576)):
        weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
        bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
        packed = gemv.pack(weight)
        assert packed.dtype == torch.bfloat16 and packed.numel() * 2 < gemv.pack(weight.float()).numel() * 4
        wide = gemv.pack(weight.float())
        x = torch.randn(9, in_features, generator=g).to(torch.bfloat16)
        for n in (1, 4, 9):
            exact = gemv.product(x[:n].float(), wide, out_features)  # the same sums on the widened weight
            assert torch.equal(gemv.product(x[:n].float(), packed, out_features), exact)
            got = gemv.product(x[:n], packed, out_features, bias)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, (exact + bias.float()).to(torch.bfloat16))
            torch.testing.assert_close(got.float(), torch.nn.functional.linear(x[:n], weight, bias).float(),
                                       atol=0.05 * in_features ** 0.5, rtol=0.02)


def test_time_gemv_times_this_build_beside_another_revisions_and_compares_bits(tmp_path):
    """scripts/time_gemv.py builds a git revision's gemv.c beside this tree's, times both and
    reports whether their outputs are the same bits (a rewrite of the kernel's loop must keep them)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("time_gemv", Path(__file__).resolve().parents[1] / "scripts" / "time_gemv.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "gemv.json"
    script.main(["--weights", "o", "--rows", "1,3", "--rounds", "1", "--reps", "1", "--against", "HEAD", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert {(r["dtype"], r["rows"]) for r in results} == {(d, n) for d in ("bfloat16", "float32") for n in (1, 3)}
    for r in results:
        assert set(r["ms"]) == {"this tree", "HEAD"} and all(ms > 0 for ms in r["ms"].values()), r
        assert r["bitwise_equal"] == {"this tree": True, "HEAD": True}, r
    with pytest.raises(SystemExit, match="unknown weight"):
        script.main(["--weights", "nope"])


def test_bfloat16_heads_run_on_the_gemv_kernels_beside_a_float32_target():
    """Under kernels='gemv' a bfloat16 layer (q/k/v stacked, and alone) is packed for the gemv
    kernels, and its outputs are the float32 product of its own weights, rounded to bfloat16."""
    model = tiny_model("llama")
    heads = tiny_model("llama", seed=1).model.layers[0].to(torch.bfloat16)
    attn, mlp = heads.self_attn, heads.mlp
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, attn.q_proj.in_features, generator=g).to(torch.bfloat16)
    h = torch.randn(1, 3, mlp.down_proj.in_features, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        want = [torch.nn.functional.linear(i.float(), layer.weight.float()).to(torch.bfloat16)
                for i, layer in ((x, attn.q_proj), (x, attn.k_proj), (h, mlp.down_proj))]
        with PackedLinears(model, heads, kernels="gemv"):
            got, calls = gemv_calls(lambda: [attn.q_proj(x), attn.k_proj(x), mlp.down_proj(h)])
    assert calls == 2  # q/k/v stacked in one product, down alone
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


LOAD = ("import torch; from medusa.runtime import gemv; w, x = torch.randn(20, 30), torch.randn(2, 30); "
        "assert torch.allclose(gemv.product(x, gemv.pack(w), 20), x @ w.T, atol=1e-5); print(gemv.library_path(gemv.compiler()))")


def load_in_a_process(cache):
    """A fresh process loads (or builds) the kernels (a library this process mapped cannot be damaged under it)."""
    env = {**os.environ, "MEDUSA_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip()), out.stderr


@pytest.mark.e2e
def test_the_library_is_built_once_and_a_damaged_one_is_rebuilt(tmp_path):
    built, _ = load_in_a_process(tmp_path)
    assert list((tmp_path / "kernels").glob("gemv-*.so")) == [built]
    stamp = built.stat().st_mtime_ns
    assert load_in_a_process(tmp_path)[0] == built and built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    for damage in (b"\x7fELF cut off", b""):
        built.write_bytes(damage)
        again, log = load_in_a_process(tmp_path)
        assert again == built and built.stat().st_size > 1000
        assert "is damaged" in log and "building it again" in log and "Traceback" not in log


def test_without_a_compiler_the_kernels_are_unavailable_in_one_line(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_library / "no-such-cc"))
    reason = gemv.unavailable_reason()
    assert reason is not None and "\n" not in reason and "kernels='onednn'" in reason
    assert not gemv.available()
    model = tiny_model("llama")
    with pytest.raises(MedusaError) as err:
        Engine(model, plan=Plan(kernels="gemv"))
    assert "\n" not in str(err.value) and "compiler" in str(err.value)
    # the kernel pick measures what this machine has and leaves gemv out
    choice, _ = Planner(True, PlanCache(fresh_library / "plan")).kernels(model, None)
    (entry,) = PlanCache(fresh_library / "plan").entries().values()
    assert "gemv" not in entry["cost_ms"] and choice.value in ("default", "onednn")


def test_a_compiler_that_fails_is_one_line(fresh_library, monkeypatch):
    fake = fresh_library / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error: unrecognized option' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    reason = gemv.unavailable_reason()
    assert reason is not None and "cannot build the gemv kernels" in reason and "unrecognized option" in reason
    assert not list((fresh_library / "kernels").glob("*.so"))  # nothing half-written left behind


def test_the_pick_takes_gemv_only_when_it_is_the_cheapest_and_clearly_faster():
    costs = {"default": {1: 62.0, 16: 150.0}, "onednn": {1: 45.0, 16: 88.0}, "gemv": {1: 30.0, 16: 85.0}}
    pick, reason = decide_kernels(costs)
    assert pick == "gemv" and "gemv" in reason and "T(1)=30.0" in reason
    assert decide_kernels({**costs, "gemv": {1: 50.0, 16: 90.0}})[0] == "onednn"
    assert decide_kernels({"default": {1: 40.0, 16: 60.0}, "gemv": {1: 39.0, 16: 58.0}})[0] == "default"


def test_the_pick_splits_by_pass_size_where_the_default_wins_the_small_passes():
    # float32 on the AMX Xeon (2026-11-29): MKL the faster up to 3 rows, gemv from 4 on
    xeon = {"default": {1: 46.9, 2: 51.7, 3: 53.9, 4: 72.9, 8: 87.5, 16: 101.0},
            "onednn": {1: 54.6, 2: 61.3, 3: 62.8, 4: 65.6, 8: 73.5, 16: 89.2},
            "gemv": {1: 55.6, 2: 61.5, 3: 62.4, 4: 62.4, 8: 67.7, 16: 78.7}}
    pick, reason = decide_kernels(xeon)
    assert pick == "gemv>3" and "above 3 rows" in reason and "T(4)=62.4" in reason
    # a split needs the default to be the cheaper at every size up to it
    assert decide_kernels({**xeon, "default": {**xeon["default"], 2: 70.0}})[0] == "gemv>1"
    assert decide_kernels({**xeon, "default": {**xeon["default"], 1: 56.0, 16: 140.0}})[0] == "gemv"
    # never in half precision, where a pass's rows must be exact with one kernel
    assert ">" not in decide_kernels({k: v for k, v in xeon.items() if k != "gemv"}, 32, half=True)[0]


def test_a_split_runs_torch_kernels_up_to_its_rows_and_gemv_above():
    model = tiny_model("llama")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        stock_small = model(input_ids=ids[:, :3]).logits
        packed = PackedLinears(model, kernels="gemv", stock_rows=3)
        with packed:
            small, small_calls = gemv_calls(lambda: model(input_ids=ids[:, :3]).logits)
            large, large_calls = gemv_calls(lambda: model(input_ids=ids).logits)
        stock_large = model(input_ids=ids).logits
    assert small_calls == 0 and torch.equal(small, stock_small)  # torch's kernels, bit for bit
    assert large_calls > 0
    torch.testing.assert_close(large, stock_large, atol=1e-5, rtol=1e-5)


def test_kernels_flags_take_splits_and_refuse_the_rest_in_one_line(capsys):
    from infer import bench
    from medusa.bench.modes import mode_spec
    from medusa.runtime.kernels import kernels_key, split_kernels

    assert split_kernels("gemv>3") == ("gemv", 3) and split_kernels("onednn") == ("onednn", None)
    assert kernels_key("gemv>3").startswith("gemv>3-p") and kernels_key("default") == "default"
    assert mode_spec("hybrid@eagle3+compile:gemv>3").kernels == "gemv>3"
    assert mode_spec("hybrid:default").kernels == "default" and mode_spec("hybrid").kernels is None
    assert mode_spec("hybrid:mkl") is None and mode_spec("hf:gemv") is None
    with pytest.raises(SystemExit):
        bench.main(["--kernels", "gemv>0", "--limit", "1"])
    err = capsys.readouterr().err
    assert "unknown kernels 'gemv>0'" in err and "Traceback" not in err


@pytest.mark.parametrize("memory", [None, 1])  # None: this machine's; 1 byte: no room for two copies
def test_the_pick_times_every_kernel_and_holds_one_packed_copy_when_memory_is_short(memory, monkeypatch):
    """With room, the packed variants are timed round-robin beside each other; without, each is
    timed against the default alone and its copy freed before the next is made."""
    live: weakref.WeakSet = weakref.WeakSet()
    most = []

    class Counted(PackedLinears):
        def __init__(self, *args, **kwargs):
            gc.collect()
            most.append(len(live) + 1)
            super().__init__(*args, **kwargs)
            live.add(self)

    monkeypatch.setattr(probes, "PackedLinears", Counted)
    model = tiny_model("llama")
    costs = probes.measure_kernels(model, prefix=8, reps=1, memory=memory)
    assert sorted(costs) == ["default", "gemv", "onednn"]
    assert all(ms > 0 for by_size in costs.values() for ms in by_size.values())
    assert most == ([1, 2] if memory is None else [1, 1])


def gemv_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key.startswith(gemv.PROFILER_NAME))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # qwen2: biases; gemma3: its own norms
def test_packed_layers_run_the_gemv_kernels_with_close_logits(arch):
    model = tiny_model(arch)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        packed = PackedLinears(model, kernels="gemv")
        with packed:
            inside, calls = gemv_calls(lambda: model(input_ids=ids).logits)
        after, calls_after = gemv_calls(lambda: model(input_ids=ids).logits)
    assert calls > 0 and calls_after == 0
    layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    groups = sibling_groups([model], linear_layers([model], "gemv"))  # q/k/v and gate/up: one product each
    assert groups and calls == layers - packed.fused + len(groups)
    torch.testing.assert_close(inside, before, atol=1e-5, rtol=1e-5)
    assert torch.equal(after, before)


def test_gemv_refuses_a_half_precision_target_in_one_line():
    model = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(MedusaError, match="float32 models on a CPU") as err:
        Engine(model, plan=Plan(kernels="gemv"))
    assert "\n" not in str(err.value)


def test_bench_linears_times_every_kernel_and_checks_row_invariance(tmp_path):
    import importlib.util
    import json

    from test_chat import draft_with_other_tokenizer

    folder = draft_with_other_tokenizer(tmp_path / "model")
    spec = importlib.util.spec_from_file_location("bench_linears", Path(__file__).parents[1] / "scripts" / "bench_linears.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "linears.json"
    assert script.main(["--model", str(folder), "--rows", "1,5", "--rounds", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for rows in ("1", "5"):
        assert set(result["rows"][rows]["ms"]) == {"default", "onednn", "gemv"}
        assert all(ms > 0 for ms in result["rows"][rows]["ms"].values())
        assert result["rows"][rows]["gemv_row_invariant"] is True
    model = tiny_model("llama", vocab_size=49152)  # the same shapes: every linear weight once, stacked or not
    linears = {id(m): m for m in model.modules() if isinstance(m, torch.nn.Linear)}.values()
    assert result["weight_bytes"] == 4 * sum(m.weight.numel() for m in linears)
