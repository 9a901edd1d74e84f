"""The training loop, in process, on a tiny real Llama with a word-level chat tokenizer."""

import json
import shutil

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from train_fixtures import tiny_target, write_counting_data

import medusa
from medusa.errors import MedusaError
from medusa.models.heads_config import read_heads_config
from medusa.training.loop import TrainConfig, latest_checkpoint, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return {"model": str(tiny_target(root / "model")), "data": str(write_counting_data(root / "count.jsonl", 48))}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # Each run builds its own Accelerator; in one process they share accelerate's singletons.
    AcceleratorState._reset_state(True)
    yield


def config(setup, out, **kw) -> TrainConfig:
    base = dict(model=setup["model"], data=[setup["data"]], max_length=48, eval_fraction=0.1, num_heads=3,
                batch_size=4, lr=1e-2, warmup_steps=2, max_steps=8, eval_every=0, eval_batches=0, log_every=1,
                save_every=0, output=str(out), wandb=False, distill=0.0, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def history(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_and_accuracy_rises_then_heads_load(setup, tmp_path):
    out = tmp_path / "heads"
    train(config(setup, out, max_steps=40, eval_every=40))
    rows = history(out)
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 40
    for k in (1, 2, 3):
        assert evals[-1][f"head{k}/top1"] > evals[0][f"head{k}/top1"] + 0.3
    cfg = read_heads_config(out)
    assert cfg.extra["training_args"]["max_steps"] == 40
    assert cfg.extra["eval_accuracy"]["head1"]["top1"] == pytest.approx(evals[-1]["head1/top1"], abs=1e-3)
    engine = medusa.load(model=setup["model"], heads=str(out), device="cpu")
    assert engine.heads is not None and engine.heads.num_heads == 3


def test_training_can_start_from_trained_heads(setup, tmp_path):
    first = tmp_path / "first"
    train(config(setup, first, max_steps=40, eval_every=40))
    trained = [r for r in history(first) if r["kind"] == "eval"][-1]
    AcceleratorState._reset_state(True)
    # a different head count is ignored: the folder's heads (3) are what training continues
    again = tmp_path / "again"
    train(config(setup, again, init_heads=str(first), num_heads=5, lr=1e-6, max_steps=2, eval_every=2))
    start = [r for r in history(again) if r["kind"] == "eval"][0]
    assert start["step"] == 0
    for k in (1, 2, 3):  # step 0 already scores what the first run reached, far above fresh heads
        assert start[f"head{k}/top1"] == pytest.approx(trained[f"head{k}/top1"], abs=0.02)
    assert read_heads_config(again).num_heads == 3


def test_self_distillation_with_feature_cache(setup, tmp_path):
    out, cache = tmp_path / "heads", tmp_path / "cache"
    cfg = config(setup, out, distill=1.0, cache_dir=str(cache), positions_per_batch=64, max_steps=30, eval_every=30)
    train(cfg)
    rows = history(out)
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert losses[-1] < 0.7 * losses[0]
    meta = cache / "train" / "meta.json"
    stamp = meta.stat().st_mtime_ns
    AcceleratorState._reset_state(True)
    train(config(setup, tmp_path / "again", distill=1.0, cache_dir=str(cache), positions_per_batch=64, max_steps=2))
    assert meta.stat().st_mtime_ns == stamp  # same data: the cache is reused, not rebuilt


def test_cache_built_with_packed_kernels_holds_the_same_features(setup, tmp_path):
    caches = {}
    for kernels in ("default", "onednn", "gemv"):
        AcceleratorState._reset_state(True)
        cache = tmp_path / kernels
        train(config(setup, tmp_path / f"heads-{kernels}", distill=1.0, cache_dir=str(cache), cache_kernels=kernels,
                     max_steps=1))
        caches[kernels] = {name: np.load(cache / "train" / f"{name}.npy") for name in ("hidden", "teacher_logp", "tokens")}
    default = caches["default"]
    for packed in (caches["onednn"], caches["gemv"]):
        assert np.array_equal(default["tokens"], packed["tokens"])
        np.testing.assert_allclose(packed["hidden"].astype(np.float32), default["hidden"].astype(np.float32), atol=2e-3)
        np.testing.assert_allclose(packed["teacher_logp"], default["teacher_logp"], atol=1e-4)
    with pytest.raises(MedusaError, match="unknown cache_kernels 'mkl'"):
        config(setup, tmp_path, cache_kernels="mkl")


@pytest.mark.parametrize("lora", [False, True], ids=["medusa1", "medusa2-lora-dropout"])
def test_resume_reaches_the_uninterrupted_result(setup, tmp_path, lora):
    kw = dict(max_steps=6, save_every=3, grad_accum=2, batch_size=2, keep_checkpoints=1)
    if lora:  # LoRA dropout draws must replay too (the resumed run's fresh data iterator draws first)
        kw.update(lora=True, lora_r=4, lora_target_modules=["q_proj", "v_proj"], lora_lr=1e-2, lora_dropout=0.1)
    full = tmp_path / "full"
    train(config(setup, full, **kw))
    # The interrupted run: all it has is the checkpoint written half way.
    resumed = tmp_path / "resumed"
    ckpt = latest_checkpoint(full)
    assert ckpt is not None and ckpt.name == "step-0000003"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    (resumed / "checkpoints" / "latest").write_text(ckpt.name)
    AcceleratorState._reset_state(True)
    train(config(setup, resumed, resume=True, **kw))
    for name in ["model.safetensors"] + (["target/model.safetensors"] if lora else []):
        a, b = load_file(full / name), load_file(resumed / name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.allclose(a[key], b[key], atol=1e-6), (name, key)
    assert [r for r in history(resumed) if r["kind"] == "train"][0]["step"] == 4


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(setup, tmp_path):
    out, cache = tmp_path / "nan", tmp_path / "cache"
    kw = dict(distill=1.0, cache_dir=str(cache), positions_per_batch=32, save_every=1)
    train(config(setup, out, max_steps=2, **kw))
    assert latest_checkpoint(out).name == "step-0000001"
    heads_stamp = (out / "model.safetensors").stat().st_mtime_ns
    # Corrupt the cached hidden states, as an fp16 overflow would: the next step's loss is NaN.
    hidden = np.load(cache / "train" / "hidden.npy", mmap_mode="r+")
    hidden[:] = np.nan
    hidden.flush()
    del hidden
    AcceleratorState._reset_state(True)
    with pytest.raises(MedusaError, match="loss became nan at step 1") as err:
        train(config(setup, out, max_steps=4, resume=True, **kw))
    good = latest_checkpoint(out)
    assert good.name == "step-0000001" and str(good) in str(err.value)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-0000001"]
    assert (out / "model.safetensors").stat().st_mtime_ns == heads_stamp  # nothing written from the bad run


def test_medusa2_lora_saves_a_loadable_target_and_heads(setup, tmp_path):
    out = tmp_path / "m2"
    train(config(setup, out, lora=True, lora_r=4, lora_target_modules=["q_proj", "v_proj"], lora_lr=1e-2,
                 distill=1.0, max_steps=4))
    cfg = read_heads_config(out)
    assert cfg.extra["medusa2"]["target"] == "target"
    tuned = load_file(out / "target" / "model.safetensors")
    original = load_file(setup["model"] + "/model.safetensors")
    changed = [k for k in original if "q_proj" in k and not torch.equal(original[k], tuned[k])]
    assert changed  # the LoRA update was merged into the saved target
    engine = medusa.load(model=str(out / "target"), heads=str(out), device="cpu")
    prompt = [4, 12, 13, 16]
    expected = engine.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):]
    assert engine.generate(prompt, max_new_tokens=8, mode="medusa").tokens == expected.tolist()
    # The KL keeping the tuned target near the original was computed and logged every step;
    # it starts at 0 (LoRA's B is zero-initialised) and grows once the adapters move.
    kl = [r["lm_kl"] for r in history(out) if r["kind"] == "train"]
    assert len(kl) == 4 and kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 1e-6


def test_retrained_heads_drop_the_stale_calibration(setup, tmp_path):
    out = tmp_path / "heads"
    train(config(setup, out, max_steps=2))
    (out / "calibration.json").write_text(json.dumps({"trees": {"cpu": [[0], [1], [0, 0]]}}))
    assert medusa.load(model=setup["model"], heads=str(out), device="cpu").heads.trees  # applied while valid
    AcceleratorState._reset_state(True)
    train(config(setup, out, max_steps=3))
    assert not (out / "calibration.json").exists()
    assert not medusa.load(model=setup["model"], heads=str(out), device="cpu").heads.trees


def test_feature_cache_is_keyed_on_the_weights_not_the_name(setup, tmp_path):
    model = tiny_target(tmp_path / "model", seed=0)
    out, cache = tmp_path / "heads", tmp_path / "cache"
    kw = dict(model=str(model), distill=1.0, cache_dir=str(cache), positions_per_batch=32, max_steps=1)
    train(config(setup, out, **kw))
    first = json.loads((cache / "train" / "meta.json").read_text())
    hidden = np.array(np.load(cache / "train" / "hidden.npy"))
    shutil.rmtree(model)
    tiny_target(model, seed=1)  # other weights, same path and name
    AcceleratorState._reset_state(True)
    train(config(setup, out, **kw))
    second = json.loads((cache / "train" / "meta.json").read_text())
    assert first != second
    assert not np.array_equal(hidden, np.load(cache / "train" / "hidden.npy"))


def test_a_cache_for_more_data_runs_the_target_over_the_new_sequences_only(setup, tmp_path, monkeypatch):
    from medusa.training import feature_build, feature_cache

    ran = []  # the real target runs; this records how many tokens it was given

    def counted(model, ids, attn):
        ran.append(int(attn.sum()))
        return run_target(model, ids, attn)

    run_target = feature_cache.run_target
    monkeypatch.setattr(feature_build, "run_target", counted)  # what open_caches runs
    more = str(write_counting_data(tmp_path / "more.jsonl", 24, seed=9, length=20))  # sequences the first lacks
    cache = tmp_path / "cache"
    kw = dict(distill=1.0, positions_per_batch=32, max_steps=1)
    train(config(setup, tmp_path / "h1", cache_dir=str(cache), **kw))
    old = {split: feature_cache.FeatureCache.open(cache / split) for split in ("train", "eval")}
    old_rows = {}  # sequence key -> its hidden rows
    for c in old.values():
        offsets = np.load(c.folder / "offsets.npy")
        for s, e in zip(offsets[:-1], offsets[1:]):
            old_rows[feature_cache.sequence_key(c.tokens[s:e], c.loss_mask[s:e])] = np.array(c.hidden[s:e])
    ran.clear()
    AcceleratorState._reset_state(True)
    train(config(setup, tmp_path / "h2", data=[setup["data"], more], cache_dir=str(cache), **kw))
    ran_grown = sum(ran)
    ran.clear()
    AcceleratorState._reset_state(True)
    train(config(setup, tmp_path / "h3", data=[setup["data"], more], cache_dir=str(tmp_path / "scratch"), **kw))
    copied = new = 0
    for split in ("train", "eval"):
        grown = feature_cache.FeatureCache.open(cache / split)
        scratch = feature_cache.FeatureCache.open(tmp_path / "scratch" / split)
        assert np.array_equal(grown.tokens, scratch.tokens)
        np.testing.assert_allclose(grown.hidden.astype(np.float32), scratch.hidden.astype(np.float32), atol=2e-3)
        offsets = np.load(grown.folder / "offsets.npy")
        for s, e in zip(offsets[:-1], offsets[1:]):
            known = old_rows.get(feature_cache.sequence_key(grown.tokens[s:e], grown.loss_mask[s:e]))
            if known is not None:  # copied from the outdated cache, bit for bit
                assert np.array_equal(grown.hidden[s:e], known)
                copied += e - s
            else:
                new += e - s
    assert copied > 0 and new > 0
    assert ran_grown == new and sum(ran) == copied + new  # the target ran over the new sequences only
    assert not list(cache.glob("*.previous"))  # the outdated caches are gone once both splits are built


def test_config_errors_are_one_line_medusa_errors(setup, tmp_path):
    with pytest.raises(MedusaError, match="lora"):
        config(setup, tmp_path, lora=True, cache_dir=str(tmp_path / "c"))
    with pytest.raises(MedusaError, match="no usable training conversations|data file not found"):
        train(config(setup, tmp_path / "x", data=[str(tmp_path / "missing.jsonl")]))


def test_wandb_logs_offline_through_accelerate_without_a_login(setup, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # conftest disables wandb; this test runs it
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no credentials anywhere to find
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "w"
    train(config(setup, out, max_steps=2, wandb=True))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))  # the run's offline log, nothing sent


def test_checkpoints_hold_the_schedule_and_resume_continues_it(setup, tmp_path):
    kw = dict(max_steps=6, save_every=3, warmup_steps=4, schedule="linear", min_lr_ratio=0.2)
    full = tmp_path / "full"
    train(config(setup, full, **kw))
    ckpt = latest_checkpoint(full)
    schedule = torch.load(ckpt / "custom_checkpoint_0.pkl", weights_only=False)  # accelerate's registered object
    assert schedule["last_epoch"] == 3  # three optimizer steps taken
    # a resumed run reads the schedule from the checkpoint (not replayed): same learning rates
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    (resumed / "checkpoints" / "latest").write_text(ckpt.name)
    AcceleratorState._reset_state(True)
    train(config(setup, resumed, resume=True, **kw))
    lrs = {r["step"]: r["lr"] for r in history(full) if r["kind"] == "train"}
    again = {r["step"]: r["lr"] for r in history(resumed) if r["kind"] == "train"}
    assert again == {s: lrs[s] for s in (4, 5, 6)}
    # each step logs the rate it used: 0 -> lr over 4 warmup steps, then linear toward min_lr_ratio * lr
    assert lrs[1] == 0 and lrs[5] == pytest.approx(1e-2, rel=1e-3)
    assert lrs[6] == pytest.approx(1e-2 * (0.2 + 0.8 * 0.5), rel=1e-3)  # half way from step 4 to max_steps 6
