"""Every command-line tool: help on every flag, defaults shown, one spelling per concept."""

import argparse
import importlib
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from train_fixtures import tiny_target

from medusa.config import TrainConfig, from_dict, parse_config
from medusa.errors import MedusaError

REPO = Path(__file__).resolve().parents[1]
MODULES = ["infer.chat", "infer.bench", "infer.precompile", "train.train_heads", "train.train_draft",
           "train.generate_selfdistill"]
SCRIPTS = ["bench_linears", "build_ngrams", "calibrate_tree", "export_heads", "head_acceptance", "heldout_prompts", "probe_compiled",
           "probe_exactness", "profile_pass", "profile_step", "publish_heads", "time_attention", "time_gemv", "time_prefill", "vllm_check"]
# One spelling per concept, in every tool that has the flag.
SPELLING = {"output": "--output", "repo_id": "--repo-id", "model": "--model", "heads": "--heads", "dtype": "--dtype",
            "device": "--device", "max_new_tokens": "--max-new-tokens", "seed": "--seed", "json": "--json",
            "prompts": "--prompts", "samples": "--samples", "trust_remote_code": "--trust-remote-code"}
# Old spellings: they still parse, hidden from the help.
OLD = {"--out", "--output_dir", "--output-dir", "--hub_model_id", "--hub-model-id", "--n", "--source"}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parsers() -> dict[str, argparse.ArgumentParser]:
    found = {name: importlib.import_module(name).build_parser() for name in MODULES}
    found.update({f"scripts/{name}.py": _script(name).build_parser() for name in SCRIPTS})
    return found


PARSERS = parsers()


def visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("tool", sorted(PARSERS))
def test_every_flag_has_help_and_its_default_shown(tool):
    parser = PARSERS[tool]
    formatter = parser._get_formatter()
    for action in visible(parser):
        assert action.help and action.help.strip(), f"{tool}: {action.option_strings or action.dest} has no help"
        switch = action.nargs == 0  # store_true and the like: off unless given
        if action.option_strings and not switch and not action.required:
            text = formatter._get_help_string(action) % {"default": action.default}
            assert "default" in text or "required" in text, f"{tool}: {action.option_strings} shows no default"
    parser.format_help()  # every help string formats (no stray %)


def test_one_spelling_per_concept_across_tools():
    spellings: dict[str, set[str]] = {}
    for tool, parser in PARSERS.items():
        for action in visible(parser):
            for option in action.option_strings:
                assert "_" not in option, f"{tool}: {option} is not dash style"
                assert option not in OLD, f"{tool}: {option} is an old spelling shown in the help"
                spellings.setdefault(action.dest, set()).add(option)
    twice = {dest: names for dest, names in spellings.items() if len(names) > 1}
    assert not twice, f"one concept spelled several ways: {twice}"
    for dest, option in SPELLING.items():
        assert spellings.get(dest, {option}) == {option}, dest
    assert {"--output", "--repo-id", "--max-new-tokens"} <= set().union(*spellings.values())


@pytest.mark.parametrize("tool, argv, dest, value", [
    ("infer.bench", ["--out", "r"], "output", "r"),
    ("scripts/export_heads.py", ["h", "--to", "vllm", "--out", "r"], "output", "r"),
    ("scripts/publish_heads.py", ["h", "--repo-id", "u/n", "--out", "r"], "output", "r"),
    ("scripts/heldout_prompts.py", ["--out", "r", "--n", "3", "--source", "s.json"], "samples", 3),
    ("scripts/heldout_prompts.py", ["--out", "r", "--source", "s.json"], "prompts", "s.json"),
    ("scripts/probe_compiled.py", ["--prompt", "12"], "prompt_tokens", 12),
])
def test_old_spellings_still_parse(tool, argv, dest, value):
    assert getattr(PARSERS[tool].parse_args(argv), dest) == value


def test_training_flags_are_dash_style_with_the_old_spellings_hidden():
    cfg = parse_config(TrainConfig, ["--max-steps", "3", "--output", "a", "--repo-id", "u/n", "--push-to-hub"])
    assert (cfg.max_steps, cfg.output, cfg.repo_id, cfg.push_to_hub) == (3, "a", "u/n", True)
    old = parse_config(TrainConfig, ["--max_steps", "4", "--output_dir", "b", "--hub_model_id", "u/m"])
    assert (old.max_steps, old.output, old.repo_id) == (4, "b", "u/m")


def test_old_yaml_keys_are_read_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="medusa.config"):
        cfg = from_dict(TrainConfig, {"output_dir": "runs/x", "hub_model_id": "u/n"}, "old.yaml")
    assert (cfg.output, cfg.repo_id) == ("runs/x", "u/n")
    assert "old.yaml: output_dir is now called output" in caplog.text
    with pytest.raises(MedusaError, match="output_dir is the old name of output: set only output"):
        from_dict(TrainConfig, {"output_dir": "a", "output": "b"}, "both.yaml")


def test_every_shipped_config_uses_the_current_keys():
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        text = path.read_text()
        assert "output_dir:" not in text and "hub_model_id:" not in text, path


@pytest.mark.e2e
def test_help_runs_and_the_training_help_names_both_head_kinds():
    for argv in (["-m", "infer.bench", "--help"], [str(REPO / "train" / "train_heads.py"), "--help"]):
        done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-800:]
    text = " ".join(done.stdout.split())
    assert "--kind medusa" in text and "--kind eagle" in text and "docs/training.md" in text
    for tool in ("train.train_draft", "train.generate_selfdistill"):
        text = " ".join(PARSERS[tool].format_help().split())
        assert "EAGLE" in text and "docs/training.md" in text, tool


def test_a_bench_without_modes_runs_the_default_mode(tmp_path):
    from infer import bench

    out = tmp_path / "bench.json"
    assert bench.main(["--model", str(tiny_target(tmp_path / "model")), "--heads", "init", "--limit", "1",
                       "--max-new-tokens", "4", "--autotune", "off", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    default = result["meta"]["default_mode"]
    assert default not in ("hf", "baseline")  # heads loaded: the default mode is one that uses them
    assert list(result["modes"]) == ["hf", "baseline", default]
