"""The dtype per device: measured once (float32 vs bfloat16 with exact attention), cached per
device, torch version and model shape, and applied by medusa.load(dtype=None)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from tiny import tiny_model
from tiny_heads import target_folder

from medusa.autotune.device import (
    BUSY_SHARE,
    KEY_VERSION,
    SIZES,
    _cached,
    adopt_picked_dtype,
    decide,
    device_key,
    model_key,
    pick_dtype,
)


def test_decide_keeps_bfloat16_only_when_clearly_faster():
    amx = {"float32": {1: 38.7, 16: 77.7}, "bfloat16": {1: 36.1, 16: 43.0}}  # the AMX Xeon's numbers
    avx2 = {"float32": {1: 61.0, 16: 111.0}, "bfloat16": {1: 400.0, 16: 900.0}}  # emulated bf16
    close = {"float32": {1: 50.0, 16: 50.0}, "bfloat16": {1: 47.0, 16: 47.0}}  # within the noise margin
    assert decide(amx)[0] == "bfloat16"
    assert decide(avx2)[0] == "float32"
    assert decide(close)[0] == "float32"
    assert decide({"float32": {1: 1.0, 16: 2.0}})[0] == "float32"
    # decided on the 16-token pass speculation verifies, not on a one-token pass
    # (exact bf16 on the AMX Xeon: slower for one token, faster for a tree)
    trees = {"float32": {1: 40.2, 16: 83.5}, "bfloat16": {1: 50.6, 16: 65.9}}
    assert decide(trees)[0] == "bfloat16"
    steps = {"float32": {1: 50.0, 16: 70.0}, "bfloat16": {1: 30.0, 16: 66.0}}
    assert decide(steps)[0] == "float32"
    assert "T(16)=43.0" in decide(amx)[1]
    assert "at most 64 rows" in decide(amx)[1]
    # faster but not batch-invariant on this device: float32, and the reason says why
    dtype, reason = decide(amx, invariant_rows=4)
    assert dtype == "float32" and "a pass of 5 rows" in reason and "not exact" in reason
    assert decide(amx, invariant_rows=None)[0] == "float32"  # not probed
    dtype, reason = decide(amx, invariant_rows=32)  # exact up to 32 rows: the engine caps its passes there
    assert dtype == "bfloat16" and "at most 32 rows" in reason


def test_device_key_names_the_device_and_torch():
    key = device_key(torch.device("cpu"))
    assert key.startswith("cpu ") and torch.__version__ in key


def test_pick_is_measured_once_and_cached(tmp_path):
    cache = tmp_path / "dtype.json"
    model = tiny_model("llama")
    first = pick_dtype(model, cache)
    assert first.dtype in ("float32", "bfloat16")
    assert set(first.cost_ms) == {"float32", "bfloat16"} and set(first.cost_ms["float32"]) == set(SIZES)
    assert all(ms > 0 for c in first.cost_ms.values() for ms in c.values())
    table = json.loads(cache.read_text())
    (key,) = table
    assert model_key(model) in key and device_key(torch.device("cpu")) in key
    # a cached entry is used as is: an edited entry wins over a new measurement
    table[key]["dtype"] = "bfloat16" if first.dtype == "float32" else "float32"
    table[key].pop("busy_share", None)  # timed while busy: it would be timed again (tested apart)
    cache.write_text(json.dumps(table))
    again = pick_dtype(model, cache)
    assert again.dtype == table[key]["dtype"] and again.reason.endswith("(cached)")
    assert model.dtype == torch.float32  # measuring left the model as it was


def test_adopt_converts_the_model_to_the_cached_choice(tmp_path):
    cache = tmp_path / "dtype.json"
    model = tiny_model("qwen2")
    key = f"{device_key(torch.device('cpu'))} | {model_key(model)} | {KEY_VERSION}"
    cache.write_text(json.dumps({key: {"dtype": "bfloat16", "reason": "bfloat16: test", "cost_ms": {}}}))
    choice = adopt_picked_dtype(model, cache)
    assert choice is not None and choice.dtype == "bfloat16"
    assert model.dtype == torch.bfloat16 and model.dtype_choice is choice
    assert adopt_picked_dtype(model, cache) is None  # not float32 any more: left alone


def test_calibrated_trees_are_kept_per_device_and_dtype():
    from medusa.decoding.engine import Engine
    from medusa.decoding.tree import tree_key
    from medusa.models.loader import init_heads_for

    assert tree_key("cpu", torch.float32) == "cpu"  # calibration.json files from before keep working
    assert tree_key("cuda", torch.bfloat16) == "cuda-bfloat16"
    model = tiny_model("llama")
    heads = init_heads_for(model, num_heads=2)
    heads.trees = {"cpu": [(0,)], "cpu-bfloat16": [(0,), (1,), (0, 0)]}
    assert Engine(model, heads=heads).tree_paths() == [(0,)]
    half = tiny_model("llama").to(torch.bfloat16)
    assert Engine(half, heads=init_heads_for(half, num_heads=2)).tree_paths() != [(0,), (1,), (0, 0)]
    bf16_heads = init_heads_for(half, num_heads=2)
    bf16_heads.trees = dict(heads.trees)
    assert Engine(half, heads=bf16_heads).tree_paths() == [(0,), (1,), (0, 0)]
    del bf16_heads.trees["cpu-bfloat16"]
    assert Engine(half, heads=bf16_heads).tree_paths() == [(0,)]  # no bf16 tree: the device's


def test_a_forced_half_precision_dtype_is_probed_and_its_passes_capped(tmp_path, monkeypatch):
    import medusa
    from medusa.autotune.device import invariant_rows
    from medusa.runtime.exact import EXACT_MAX_ROWS, set_exact

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    folder = str(target_folder(tmp_path))
    eng = medusa.load(model=folder, heads="init", dtype="bfloat16", kernels="default")
    assert eng.model.dtype == torch.bfloat16 and eng.exact
    table = json.loads((tmp_path / "cache" / "dtype.json").read_text())
    (key,) = [k for k in table if k.startswith("rows | ") and "| default |" in k]
    probed = table[key]["invariant_rows"]
    # the probe on this model, as the engine runs it, and the cap the engine took from it
    half = tiny_model("llama", vocab_size=eng.model.config.vocab_size)
    half.load_state_dict(eng.model.state_dict())
    half = half.to(torch.bfloat16)
    set_exact(half, True)
    assert probed == invariant_rows(half)
    assert eng.max_rows == min(probed, EXACT_MAX_ROWS)
    ids = [2, 3, 4, 5, 3, 4, 5, 3]
    base = eng.generate(ids, max_new_tokens=16, mode="baseline").tokens
    assert eng.generate(ids, max_new_tokens=16, mode="hybrid").tokens == base
    # packed weights are other kernels: probed again with them, and the cap taken from that probe
    from medusa.errors import MedusaError
    from medusa.runtime.kernels import onednn_available

    if not onednn_available("cpu", torch.bfloat16):  # an AVX2-only CPU packs no bf16 weights
        with pytest.raises(MedusaError, match="oneDNN torch.bfloat16 linears"):
            medusa.load(model=folder, heads="init", dtype="bfloat16", kernels="onednn")
        return
    packed = medusa.load(model=folder, heads="init", dtype="bfloat16", kernels="onednn")
    table = json.loads((tmp_path / "cache" / "dtype.json").read_text())
    (key,) = [k for k in table if k.startswith("rows | ") and "| onednn-p" in k]
    assert packed.max_rows == min(table[key]["invariant_rows"], EXACT_MAX_ROWS)
    own = packed.generate(ids, max_new_tokens=16, mode="baseline").tokens
    assert packed.generate(ids, max_new_tokens=16, mode="hybrid").tokens == own


def test_compile_on_the_cpu_picks_the_dtype_and_half_precision_compiles_exact(tmp_path, monkeypatch):
    import medusa
    from medusa.decoding.engine import Engine

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    eng = medusa.load(model=str(target_folder(tmp_path)), heads="init", compile="aot_eager")
    assert "compile=True" not in eng.model.dtype_choice.reason  # the pick, as without compile
    assert (tmp_path / "cache" / "dtype.json").exists()
    assert eng.exact == (eng.model.dtype == torch.bfloat16) and eng.passes.compiled
    half = tiny_model("llama").to(torch.bfloat16)
    assert Engine(half, compile="aot_eager").exact  # compiled exact passes (tests/test_compiled_exact.py)
    assert Engine(half, compile="aot_eager", exact=False).max_rows is None  # the caller's explicit opt-out


def _timing(calls: list[int]):
    def measure() -> dict:  # a stand-in for a pick's timing: half a second of this process's work
        calls.append(1)
        x, t0 = torch.randn(128, 128), time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            x = torch.tanh(x @ x)
        return {"reason": "timed"}
    return measure


def test_a_pick_timed_while_other_processes_ran_is_timed_again_once_the_machine_is_idle(tmp_path):
    cache, calls = tmp_path / "pick.json", []
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        entry, cached = _cached(cache, "key", _timing(calls))
        assert not cached and entry["busy_share"] >= BUSY_SHARE and "timed again once the machine is idle" in entry["reason"]
        assert json.loads(cache.read_text())["key"]["busy_share"] == entry["busy_share"]
        entry, cached = _cached(cache, "key", _timing(calls))  # still busy: the entry is kept
        assert cached and len(calls) == 1
        probe, _ = _cached(tmp_path / "rows.json", "key", _timing([]), timed=False)  # not a timing: never marked
        assert "busy_share" not in probe
    finally:
        for p in burners:
            p.kill()
            p.wait()
    entry, cached = _cached(cache, "key", _timing(calls))  # idle now: timed again, and the mark is gone
    assert not cached and len(calls) == 2 and "busy_share" not in entry and entry["reason"] == "timed"
    entry, cached = _cached(cache, "key", _timing(calls))
    assert cached and len(calls) == 2
