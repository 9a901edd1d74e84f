"""Real vLLM with the shipped heads exported: the same greedy output as the engine.

Runs ``scripts/vllm_check.py`` on the embedded SmolLM2-135M (float32, batch 1, 3 prompts x
32 tokens) for the three kinds of shipped heads: the Medusa heads (vLLM's ``"method": "medusa"``),
the EAGLE heads in the eagle1 layout (vLLM's EAGLE-1 drafter, ``"method": "eagle"``) and the
EAGLE-3 heads with their draft vocabulary (vLLM's EAGLE-3 Llama drafter, ``"method": "eagle3"``).
vLLM lives in its own venv (``~/.cache/medusa/vllm-venv``, created on first use: about 4-5
minutes here, then reused); where it cannot be installed the test fails and says so.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_heads import REPO

from medusa.errors import MedusaError
from medusa.peers.vllm_client import VLLMWorker, vllm_python


def load_script():
    spec = importlib.util.spec_from_file_location("vllm_check", REPO / "scripts" / "vllm_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.peers
def test_vllm_with_exported_medusa_and_eagle_heads_decodes_like_the_engine(tmp_path):
    try:
        vllm_python()
    except MedusaError as err:
        pytest.fail(f"vLLM could not be installed on this machine, so the export is unchecked: {err}", pytrace=False)
    out = tmp_path / "report.json"
    rc = load_script().main(["--max-new-tokens", "32", "--json", str(out)])
    report = json.loads(out.read_text())
    checks = {c["spec"]["method"]: c for c in report["checks"]}
    assert sorted(checks) == ["eagle", "eagle3", "medusa"]
    assert checks["medusa"]["spec"]["num_speculative_tokens"] == 4 and checks["eagle"]["spec"]["num_speculative_tokens"] == 3
    assert checks["eagle3"]["spec"]["num_speculative_tokens"] == 7
    for method, check in checks.items():
        rows = check["prompts"]
        assert len(rows) == 3
        for row in rows:
            assert row["identical"], (f"vLLM ({method}) differs from the engine from token {row['first_difference']} "
                                      f"on {row['prompt']!r}")
            assert len(row["vllm_tokens"]) > 0
            # vLLM really drafted with the exported heads, and they were right some of the time.
            assert row["vllm_spec"]["drafts"] > 0 and row["vllm_spec"]["accepted_tokens"] > 0, method
        # The export computes the heads' function: vLLM's top-1 chain drafts are accepted as
        # often as the engine's identical chain drafts (slack for float near-ties between the
        # two stacks: one flipped draft moves a 3 x 32-token mean by a few percent).
        engine_tau = sum(r["engine_tau"] for r in rows) / len(rows)
        vllm_tau = sum(r["vllm_tau"] for r in rows) / len(rows)
        assert abs(engine_tau - vllm_tau) <= 0.2 * engine_tau, (method, engine_tau, vllm_tau)
    assert rc == 0


@pytest.mark.peers
def test_vllm_serves_the_speculators_eagle3_export_alone_like_the_engine(tmp_path):
    """``vllm serve FOLDER`` on the speculators export: no speculative config is passed, vLLM takes
    the verifier, the method and the speculative tokens from the folder's config."""
    from medusa.api import SHIPPED_EAGLE3_HEADS

    try:
        vllm_python()
    except MedusaError as err:
        pytest.fail(f"vLLM could not be installed on this machine, so the export is unchecked: {err}", pytrace=False)
    out = tmp_path / "report.json"
    rc = load_script().main(["--layout", "speculators", "--heads", str(SHIPPED_EAGLE3_HEADS), "--max-new-tokens", "32",
                             "--prompt", "Explain in two sentences why the sky is blue.", "--export-dir", str(tmp_path / "x"),
                             "--json", str(out)])
    (check,) = json.loads(out.read_text())["checks"]
    assert check["layout"] == "speculators" and check["spec"]["method"] == "eagle3"
    assert json.loads((tmp_path / "x" / "heads-vllm-0" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    (row,) = check["prompts"]
    assert row["identical"], f"vLLM differs from the engine from token {row['first_difference']}"
    assert row["vllm_spec"]["drafts"] > 0 and row["vllm_spec"]["accepted_tokens"] > 0
    assert rc == 0


def test_medusa_heads_export_to_vllm_s_medusa_layout_by_default(tmp_path):
    """vLLM serves no speculators ``medusa`` folder (SERVES_SPECULATORS): the default export of Medusa
    heads is the layout it serves with a speculative config; the speculators one is written when asked."""
    from tiny_heads import target_folder

    from medusa.models.heads_config import save_heads
    from medusa.models.loader import init_heads_for
    from medusa.models.target import load_target
    from medusa.peers.vllm_client import SERVES_SPECULATORS

    spec = importlib.util.spec_from_file_location("export_heads", REPO / "scripts" / "export_heads.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder = target_folder(tmp_path)
    model, _ = load_target(str(folder), device="cpu", dtype=torch.float32)
    heads = save_heads(init_heads_for(model), tmp_path / "medusa")
    assert script.main([str(heads), "--model", str(folder), "--output", str(tmp_path / "default")]) == 0
    assert "speculators_model_type" not in json.loads((tmp_path / "default" / "config.json").read_text())
    assert script.main([str(heads), "--model", str(folder), "--to", "speculators", "--output", str(tmp_path / "spec")]) == 0
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_model_type"] == "medusa"
    assert "medusa" not in SERVES_SPECULATORS and "eagle3" in SERVES_SPECULATORS


def test_a_missing_vllm_python_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MEDUSA_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(MedusaError, match="MEDUSA_VLLM_PYTHON") as err:
        vllm_python()
    assert "\n" not in str(err.value)


def test_a_python_without_vllm_fails_with_the_worker_s_reason():
    # This project's own venv has no vLLM: the worker starts, fails to import it, and the
    # client reports why in one line instead of waiting for a reply.
    with pytest.raises(MedusaError, match="No module named 'vllm'") as err:
        VLLMWorker(REPO, None, python=sys.executable, startup_timeout=120)
    assert "\n" not in str(err.value) and "worker exited" in str(err.value)


def test_bench_mode_vllm_eagle_exports_eagle1_heads_and_refuses_norms_heads(tmp_path):
    # The speculative config the bench's vllm-eagle worker gets (no vLLM needed to build it).
    import argparse

    import torch
    from test_export import noisy_eagle1
    from tiny_heads import target_folder

    from medusa.bench.vllm_peer import close_all, speculative_config
    from medusa.models.eagle_heads import init_eagle_for
    from medusa.models.heads_config import save_heads
    from medusa.models.target import load_target

    folder = target_folder(tmp_path)
    model, _ = load_target(str(folder), device="cpu", dtype=torch.float32)
    eagle1 = save_heads(noisy_eagle1(model), tmp_path / "eagle1")
    args = argparse.Namespace(model=str(folder), heads=None, eagle_heads=str(eagle1))
    try:
        spec = speculative_config("vllm-eagle", args)
        assert spec["method"] == "eagle" and spec["num_speculative_tokens"] == 2
        assert (Path(spec["model"]) / "config.json").is_file()
        # --heads holding eagle heads serve too, as for the bench's eagle modes
        assert speculative_config("vllm-eagle", argparse.Namespace(model=str(folder), heads=str(eagle1),
                                                                   eagle_heads=None))["method"] == "eagle"
        norms = save_heads(init_eagle_for(model, num_steps=2), tmp_path / "norms")
        with pytest.raises(MedusaError, match="eagle_layout: eagle1"):
            speculative_config("vllm-eagle", argparse.Namespace(model=str(folder), heads=None, eagle_heads=str(norms)))
    finally:
        close_all()


def test_bench_mode_vllm_eagle3_exports_eagle3_heads(tmp_path):
    # The speculative config the bench's vllm-eagle3 worker gets (no vLLM needed to build it).
    import argparse

    import torch
    from tiny_heads import target_folder

    from medusa.bench.vllm_peer import close_all, speculative_config
    from medusa.models.eagle3_heads import init_eagle3_for
    from medusa.models.heads_config import save_heads
    from medusa.models.loader import init_heads_for
    from medusa.models.target import load_target

    folder = target_folder(tmp_path)
    model, _ = load_target(str(folder), device="cpu", dtype=torch.float32)
    # vLLM's drafter fuses three target layers; the tiny target has two, so one is read twice
    eagle3 = save_heads(init_eagle3_for(model, 5, vocab=torch.arange(0, model.config.vocab_size, 2),
                                        feature_layers=[0, 1, 1]), tmp_path / "e3")
    try:
        spec = speculative_config("vllm-eagle3", argparse.Namespace(model=str(folder), heads=None, eagle3_heads=str(eagle3)))
        assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 5
        exported = json.loads((Path(spec["model"]) / "config.json").read_text())
        assert exported["architectures"] == ["LlamaForCausalLMEagle3"]
        # --heads holding eagle3 heads serve too; Medusa heads there are not taken for them
        assert speculative_config("vllm-eagle3", argparse.Namespace(model=str(folder), heads=str(eagle3),
                                                                    eagle3_heads=None))["method"] == "eagle3"
        medusa_heads = save_heads(init_heads_for(model), tmp_path / "medusa")
        with pytest.raises(MedusaError, match="needs trained eagle3 heads"):
            speculative_config("vllm-eagle3", argparse.Namespace(model=str(folder), heads=str(medusa_heads),
                                                                 eagle3_heads=None))
    finally:
        close_all()
