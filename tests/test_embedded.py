"""The embedded default model: loads offline, chats, and medusa decoding matches HF generate."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from medusa.models.target import DEFAULT_MODEL_NAME, default_model_dir, eos_token_ids

ROOT = Path(__file__).resolve().parent.parent
# the embedded model at length, the bench command as a process: the end-to-end tier (make test-all)
pytestmark = pytest.mark.e2e


def chat_ids(engine, text):
    out = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_embedded_model_is_the_real_smollm2(embedded):
    cfg = embedded.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert embedded.model.num_parameters() > 130e6
    assert default_model_dir().name == DEFAULT_MODEL_NAME
    assert (default_model_dir() / "model.safetensors").is_file()
    assert eos_token_ids(embedded.model, embedded.tokenizer) == [embedded.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_embedded_model_answers_and_medusa_matches_hf(embedded):
    ids = chat_ids(embedded, "What is the capital of France?")
    n = 24
    hf = embedded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=GenerationConfig(do_sample=False, max_new_tokens=n,
                                                                    eos_token_id=sorted(embedded.eos), pad_token_id=2))
    ref = hf[0, len(ids):].tolist()
    med = embedded.generate(ids, max_new_tokens=n, mode="medusa")
    assert med.tokens == ref
    assert "Paris" in embedded.tokenizer.decode(med.tokens)


def test_bench_cli_on_the_embedded_model(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "infer.bench", "--heads", "init", "--limit", "2", "--max-new-tokens", "12",
                           "--modes", "hf,baseline,medusa", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| medusa |" in proc.stdout and "yes (2/2)" in proc.stdout
    data = json.loads(out.read_text())
    modes = data["modes"]
    assert set(modes) == {"hf", "baseline", "medusa"}
    for name in ("baseline", "medusa"):
        assert modes[name]["identical"] == 2
        assert [p["tokens"] for p in modes[name]["per_prompt"]] == [p["tokens"] for p in modes["hf"]["per_prompt"]]
    assert all(len(p["tokens"]) > 0 for p in modes["hf"]["per_prompt"])
    assert modes["medusa"]["tau"] >= 1.0
    # where a step's time went, per engine mode (transformers' generate does not say)
    assert modes["hf"]["step_ms"] is None
    for name in ("baseline", "medusa"):
        ms = modes[name]["step_ms"]
        assert set(ms) == {"draft", "verify", "update", "other"} and ms["verify"] > 0
        assert re.search(rf"step profile, {name}: [\d.]+ ms per step = draft [\d.]+ \+ verify [\d.]+ \(\d+%\)", proc.stdout)
    assert modes["medusa"]["step_ms"]["draft"] > modes["baseline"]["step_ms"]["draft"]  # heads draft, baseline does not


def test_bench_cli_rejects_unknown_modes():
    proc = subprocess.run([sys.executable, "-m", "infer.bench", "--modes", "hf,warp"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown mode(s) warp")
    assert "Traceback" not in proc.stderr
