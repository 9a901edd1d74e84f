"""The target's dtype: decided by the plan's rule (medusa/autotune/dtype.py; golden cases in
test_plan.py), applied by medusa.load(dtype=None), and a half-precision target's passes capped
at the rows its probe found exact (cached in plan.json)."""

import json

import pytest
import torch
from tiny import tiny_model
from tiny_heads import target_folder

from medusa.autotune.cache import FILE
from medusa.decoding.plan import Plan


def _entries(folder):
    return json.loads((folder / FILE).read_text())["entries"]


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
    table = _entries(tmp_path / "cache")
    (key,) = [k for k in table if k.startswith("rows | ") and k.endswith("| default")]
    probed = table[key]["rows"]
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
        pytest.skip("this CPU packs no oneDNN bfloat16 weights: only their refusal was checked")
    packed = medusa.load(model=folder, heads="init", dtype="bfloat16", kernels="onednn")
    table = _entries(tmp_path / "cache")
    rows = [k for k in table if k.startswith("rows | ") and "| onednn-p" in k]
    probed = table[rows[0]]["rows"] if rows else packed.plan.decision("rows").value  # or with the kernel pick
    assert packed.max_rows == min(probed, EXACT_MAX_ROWS)
    own = packed.generate(ids, max_new_tokens=16, mode="baseline").tokens
    assert packed.generate(ids, max_new_tokens=16, mode="hybrid").tokens == own


def test_compile_on_the_cpu_picks_the_dtype_and_half_precision_compiles_exact(tmp_path, monkeypatch):
    import medusa
    from medusa.decoding.engine import Engine

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    eng = medusa.load(model=str(target_folder(tmp_path)), heads="init", compile="aot_eager")
    assert "compile=True" not in eng.plan.decision("dtype").reason  # the pick, as without compile
    assert (tmp_path / "cache" / FILE).exists()
    assert eng.exact == (eng.model.dtype == torch.bfloat16) and eng.passes.compiled
    half = tiny_model("llama").to(torch.bfloat16)
    assert Engine(half, compile="aot_eager").exact  # compiled exact passes (tests/test_compiled_exact.py)
    assert Engine(half, compile="aot_eager", plan=Plan(exact=False)).max_rows is None  # the caller's explicit opt-out
