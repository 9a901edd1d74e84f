"""Configs: every shipped YAML loads into its dataclass; flags override YAML; typos fail."""

import json
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import yaml

from medusa.config import arg, diff_from_defaults, parse_config
from medusa.errors import MedusaError
from medusa.training.loop import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").rglob("*.yaml"))  # experiments/ too
ACCELERATE_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))


@dataclass
class Toy:
    """A toy config."""

    name: str = arg("a", "a name")
    steps: int = arg(3, "steps")
    rate: float = arg(0.5, "rate")
    flag: bool = arg(False, "a switch")
    items: list[str] = arg(["x"], "items")
    maybe: int | None = arg(None, "optional")
    mode: str = arg("fast", "mode", choices=("fast", "slow"))


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "toy.yaml"
    path.write_text("steps: 10\nitems: [p, q]\nrate: 1e-3\n")
    cfg = parse_config(Toy, ["--config", str(path), "--steps", "7", "--flag", "--maybe", "4"])
    assert (cfg.steps, cfg.items, cfg.rate, cfg.flag, cfg.maybe, cfg.name) == (7, ["p", "q"], 1e-3, True, 4, "a")
    assert parse_config(Toy, ["--items", "u,v", "--flag", "false", "--maybe", "none"]).items == ["u", "v"]
    assert diff_from_defaults(cfg) == {"steps": 7, "items": ["p", "q"], "rate": 1e-3, "flag": True, "maybe": 4}


@pytest.mark.parametrize("args,match", [
    (["--steps", "many"], "expects int"),
    (["--mode", "medium"], "not one of"),
    (["--flag", "perhaps"], "expects bool"),
])
def test_bad_values_are_medusa_errors(args, match):
    with pytest.raises(MedusaError, match=match):
        parse_config(Toy, args)


@pytest.mark.parametrize("field, value, match", [
    ("batch_size", "0", "batch_size=0 must be at least 1"),  # was a ZeroDivisionError after tokenising
    ("grad_accum", "0", "grad_accum=0 must be at least 1"),
    ("num_heads", "0", "num_heads=0 must be at least 1"),
    ("keep_checkpoints", "0", "keep_checkpoints=0 must be at least 1"),  # would delete the checkpoint just saved
    ("eval_fraction", "0.9", "eval_fraction=0.9 must be between 0 and 0.5"),
    ("lr", "-0.001", "lr=-0.001 must be at least 0"),
    ("lora_dropout", "1.5", "lora_dropout=1.5 must be between 0 and 1"),
    ("max_samples", "0", "max_samples=0 must be at least 1"),
])
def test_training_values_out_of_range_are_refused_before_anything_loads(field, value, match, tmp_path):
    from medusa.training.draft_task import DraftTrainConfig

    with pytest.raises(MedusaError, match=f"^flags: {match}$"):
        parse_config(TrainConfig, [f"--{field}", value])
    path = tmp_path / "c.yaml"
    path.write_text(f"{field}: {value}\n")
    with pytest.raises(MedusaError, match=f"{path}: {match}"):
        parse_config(TrainConfig, ["--config", str(path)])
    if field in {f.name for f in fields(DraftTrainConfig)}:  # the shared fields keep their bounds in the draft's schema
        with pytest.raises(MedusaError, match=match):
            parse_config(DraftTrainConfig, [f"--{field}", value])
    parse_config(TrainConfig, [f"--{field}", "0.5" if field in ("eval_fraction", "lora_dropout", "lr") else "1"])


def test_unknown_yaml_key_is_rejected(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("stepz: 3\n")
    with pytest.raises(MedusaError, match="unknown field.*stepz"):
        parse_config(Toy, ["--config", str(path)])


def test_every_field_has_help():
    import dataclasses

    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_train_yaml_loads_and_documents_its_command(path):
    cfg = parse_config(TrainConfig, ["--config", str(path)])
    assert isinstance(cfg, TrainConfig)
    first = path.read_text().splitlines()
    command = next(line for line in first if "accelerate launch" in line)
    assert f"--config {path.relative_to(ROOT).as_posix()}" in command
    cf = command.split("--config_file ")[1].split()[0]
    assert (ROOT / cf).is_file()


def test_gpu_configs_exist_for_the_named_targets():
    names = {p.name for p in TRAIN_CONFIGS}
    for name in ("smollm2-135m.yaml", "llama-3.1-8b-instruct.yaml", "qwen2.5-7b-instruct.yaml", "vicuna-7b-v1.3.yaml"):
        assert name in names


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_yaml(path):
    cfg = yaml.safe_load(path.read_text())
    assert cfg["distributed_type"] in ("NO", "MULTI_GPU", "DEEPSPEED")
    if cfg["distributed_type"] == "DEEPSPEED":
        ds_file = ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] in (2, 3)
        assert "mixed_precision" not in cfg  # accelerate refuses it next to a DeepSpeed file
    assert "accelerate launch" in path.read_text().splitlines()[1]


def test_heads_and_draft_share_one_schema_for_common_settings(tmp_path, caplog):
    from medusa.training.draft_task import DraftTrainConfig

    shared = {f.name for f in fields(TrainConfig)} & {f.name for f in fields(DraftTrainConfig)}
    assert {"model", "data", "max_length", "cache_dir", "teacher_topk", "train_vocab", "lr", "eval_every"} <= shared
    shared.discard("output")  # a heads folder vs a draft model folder: the one field that means two things
    helps = [{f.name: f.metadata["help"] for f in fields(cls) if f.name in shared} for cls in (TrainConfig, DraftTrainConfig)]
    assert helps[0] == helps[1]  # one help text per setting
    # The draft's old name of the teacher's top-k still reads from YAML, with a message naming the new one.
    path = tmp_path / "draft.yaml"
    path.write_text("cache_topk: 16\n")
    with caplog.at_level("WARNING"):
        assert parse_config(DraftTrainConfig, ["--config", str(path)]).teacher_topk == 16
    assert "cache_topk is now called teacher_topk" in caplog.text
    path.write_text("cache_topk: 16\nteacher_topk: 8\n")
    with pytest.raises(MedusaError, match="set only teacher_topk"):
        parse_config(DraftTrainConfig, ["--config", str(path)])
