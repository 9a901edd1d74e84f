"""Distilling a draft: the loop runs end to end and the draft gets closer to its target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model
from train_fixtures import tiny_target, write_counting_data

import medusa
from medusa.config import parse_config
from medusa.errors import MedusaError
from medusa.training.draft_task import RECORD, DraftTrainConfig, distill_loss, topk_distill_loss
from train.train_draft import main

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_thread")


def test_distilled_draft_is_closer_to_the_target_and_loads(tmp_path):
    target_dir = tiny_target(tmp_path / "target")
    data = write_counting_data(tmp_path / "data.jsonl", 80)
    out = tmp_path / "draft"
    assert main(["--model", str(target_dir), "--data", str(data), "--draft-layers", "1", "--max-steps", "40",
                 "--batch-size", "8", "--lr", "0.01", "--warmup-steps", "2", "--eval-fraction", "0.1",
                 "--eval-every", "20", "--output", str(out)]) == 0
    record = json.loads((out / RECORD).read_text())
    assert record["steps"] == 40 and [h["step"] for h in record["eval_history"]] == [20, 40]
    assert record["eval_after"]["kl"] < 0.7 * record["eval_before"]["kl"]
    assert record["eval_after"]["agreement"] >= record["eval_before"]["agreement"]
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob(".draft-*"))
    engine = medusa.load(model=str(target_dir), draft=str(out), device="cpu", draft_tokens=3)
    assert engine.draft.config.num_hidden_layers == 1
    # the embeddings stayed the target's own (only the layers and the norm trained)
    torch.testing.assert_close(engine.draft.get_input_embeddings().weight, engine.model.get_input_embeddings().weight)
    prompt = [2, 8, 10, 12, 3]
    draft = engine.generate(prompt, max_new_tokens=20, mode="draft")
    assert draft.tokens == engine.generate(prompt, max_new_tokens=20, mode="baseline").tokens


def test_time_limit_stops_early_and_still_saves(tmp_path):
    target_dir = tiny_target(tmp_path / "target")
    data = write_counting_data(tmp_path / "data.jsonl", 20)
    out = tmp_path / "draft"
    assert main(["--model", str(target_dir), "--data", str(data), "--draft-layers", "1", "--max-steps", "100000",
                 "--max-minutes", "0.002", "--eval-fraction", "0.1", "--output", str(out)]) == 0
    record = json.loads((out / RECORD).read_text())
    assert 0 < record["steps"] < 100000 and record["planned_steps"] == 100000


def test_config_defaults_write_the_default_draft_and_bad_values_are_errors():
    cfg = parse_config(DraftTrainConfig, [])
    assert cfg.model is None and cfg.output_path() == medusa.models.draft.default_draft_dir()
    assert parse_config(DraftTrainConfig, ["--model", "x/y"]).output_path().name == "draft"
    with pytest.raises(MedusaError, match="temperature"):
        parse_config(DraftTrainConfig, ["--temperature", "0"])


def test_topk_distill_loss_is_the_kl_to_the_teachers_top_k():
    model = tiny_model("llama", vocab_size=24)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 64, generator=g)
    teacher = torch.randn(5, 24, generator=g) * 3  # [n, V] a teacher's logits
    student = hidden @ model.get_output_embeddings().weight.T  # [n, V]
    # the teacher's whole vocabulary as its "top-k": exactly the full KL(teacher || student)
    ids = teacher.argsort(-1, descending=True)
    logp = torch.log_softmax(teacher, -1).gather(-1, ids)
    full, _ = distill_loss(student, teacher, 1.0)
    torch.testing.assert_close(topk_distill_loss(model, hidden, ids, logp, None, None), full)
    # a subset: both sides renormalised over it, teacher ids outside it dropped
    vocab = torch.arange(0, 24, 2)
    index = torch.full((24,), -1)
    index[vocab] = torch.arange(len(vocab))
    t = torch.log_softmax(teacher[:, vocab], -1)
    s = torch.log_softmax(student[:, vocab], -1)
    expected = (t.exp() * (t - s)).sum(-1).mean()
    torch.testing.assert_close(topk_distill_loss(model, hidden, ids, logp, vocab, index), expected)


def test_cached_distillation_builds_then_reuses_the_feature_cache(tmp_path):
    target_dir = tiny_target(tmp_path / "target")
    data = write_counting_data(tmp_path / "data.jsonl", 60)
    cache = tmp_path / "cache"
    args = ["--model", str(target_dir), "--data", str(data), "--draft-layers", "1", "--max-steps", "30",
            "--batch-size", "8", "--lr", "0.01", "--warmup-steps", "2", "--eval-fraction", "0.1",
            "--eval-every", "0", "--cache-dir", str(cache), "--train-vocab", "16"]
    assert main(args + ["--output", str(tmp_path / "a")]) == 0
    record = json.loads((tmp_path / "a" / RECORD).read_text())
    # (the softmax covers 16 of the ~24 ids: the held-out KL over all of them falls less)
    assert record["eval_after"]["kl"] < 0.85 * record["eval_before"]["kl"]
    built = (cache / "train" / "hidden.npy").stat().st_mtime_ns
    assert main(args + ["--output", str(tmp_path / "b")]) == 0
    assert (cache / "train" / "hidden.npy").stat().st_mtime_ns == built  # read, not rebuilt
    again = json.loads((tmp_path / "b" / RECORD).read_text())
    assert again["eval_after"]["kl"] == pytest.approx(record["eval_after"]["kl"], rel=1e-4)  # same run, same result


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "draft").glob("*.yaml")), ids=lambda p: p.name)
def test_draft_yaml_loads_and_documents_its_command(path):
    cfg = parse_config(DraftTrainConfig, ["--config", str(path)])
    assert isinstance(cfg, DraftTrainConfig)
    assert f"python -m train.train_draft --config configs/draft/{path.name}" in path.read_text()


def test_draft_training_resumes_to_the_uninterrupted_result(tmp_path):
    import shutil

    from safetensors.torch import load_file

    from medusa.training.checkpoints import latest_checkpoint

    target_dir = tiny_target(tmp_path / "target")
    data = write_counting_data(tmp_path / "data.jsonl", 40)
    args = ["--model", str(target_dir), "--data", str(data), "--draft-layers", "1", "--max-steps", "6",
            "--batch-size", "2", "--grad-accum", "2", "--lr", "0.01", "--warmup-steps", "2", "--eval-fraction", "0.1",
            "--eval-every", "0", "--save-every", "3", "--keep-checkpoints", "1", "--log-every", "1"]
    full = tmp_path / "full"
    assert main(args + ["--output", str(full)]) == 0
    ckpt = latest_checkpoint(full)
    assert ckpt is not None and ckpt.name == "step-0000003"  # kept next to the draft written over it
    saved = load_file(ckpt / "model.safetensors")
    assert saved and not any("embed_tokens" in k or "lm_head" in k for k in saved)  # only what trains
    # The interrupted run: all it has is the checkpoint written half way.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    (resumed / "checkpoints" / "latest").write_text(ckpt.name)
    assert main(args + ["--output", str(resumed), "--resume"]) == 0
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    full_rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [4, 5, 6]
    assert train_rows == [r for r in full_rows if r["kind"] == "train" and r["step"] > 3]  # same losses, same lr
    assert json.loads((resumed / RECORD).read_text())["steps"] == 6


def test_draft_logs_to_wandb_offline_and_keeps_the_log(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # conftest disables wandb; this test runs it
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no credentials anywhere to find
    monkeypatch.setenv("WANDB_SILENT", "true")
    target_dir = tiny_target(tmp_path / "target")
    data = write_counting_data(tmp_path / "data.jsonl", 20)
    out = tmp_path / "draft"
    assert main(["--model", str(target_dir), "--data", str(data), "--draft-layers", "1", "--max-steps", "2",
                 "--eval-fraction", "0.1", "--wandb", "true", "--output", str(out)]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))  # kept when the draft folder was swapped in
    assert (out / "model.safetensors").is_file() and (out / "metrics.jsonl").is_file()
