"""Every command the docs show parses with the tool's own parser, and every config it names loads.

Commands are read from README.md, docs/**/*.md and the header comments of configs/train/**/*.yaml
(each recipe starts with the command that runs it): fenced code blocks and inline `code` spans
that start with ``python -m infer.*``, ``python -m train.*``, ``python train/*.py``,
``python scripts/*.py``, ``medusa-chat``, ``accelerate launch ...`` or ``make ...``. For each:

- the tool's ``build_parser()`` accepts the arguments (``accelerate launch``: accelerate's own
  launch parser, then the script's);
- training commands build their config as the tool does (``medusa.config.parse_config``: the
  YAML loads and every field checks);
- mode names (``--mode``, ``--modes``, ``mode="..."`` in Python examples) are ones the tools take;
- accelerate launch configs exist and load, and so do the DeepSpeed files they point at;
- every path under ``configs/`` exists; ``make`` targets exist in the Makefile.

Paths outside ``configs/`` (prompt files a benchmark run wrote, output folders) need not exist:
the parser is asked whether it takes the arguments, not whether a scratch file is there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RECIPES = sorted([*(REPO / "configs" / "train").rglob("*.yaml"), *(REPO / "configs" / "draft").rglob("*.yaml")])
STARTS = re.compile(r"^(python3? -m (infer|train)\.|python3? (train|scripts)/|medusa-chat\b|accelerate launch\b|make\b)")
FENCE = re.compile(r"^([ \t]*)```([^\n`]*)\n(.*?)^\1```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*?)`")  # inline code, which may wrap over lines of a paragraph
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")  # VAR=value before a command
# the config class each training tool builds from --config and its flags (medusa.config.parse_config)
TRAIN_TOOLS = {"train.train_heads": "TrainConfig", "train.train_draft": "DraftTrainConfig",
               "train.generate_selfdistill": "SelfDistillConfig"}


@dataclass(frozen=True)
class Command:
    text: str  # one command, continuation lines joined
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _commands_in_text(text: str) -> list[str]:
    """The commands of a shell snippet: continuations joined, comments dropped, split at | ; && & >."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()  # a comment (a # inside a word stays)
        for part in re.split(r"\s*(?:\|\||&&|\||;|&)\s*", line):
            part = re.split(r"\s+\d?>\s*", " " + part)[0].strip()  # drop redirections
            words = part.split()
            while words and ENV.match(words[0]):
                words.pop(0)
            part = " ".join(words)
            if STARTS.match(part):
                out.append(part)
    return out


def doc_commands(path: Path) -> list[Command]:
    text = path.read_text()
    found: list[Command] = []

    def line_of(offset: int) -> str:
        return f"{_rel(path)}:{text.count(chr(10), 0, offset) + 1}"

    prose = text
    for block in FENCE.finditer(text):
        lang = block[2].strip().lower()
        if lang in ("", "bash", "sh", "shell", "console", "text"):
            found += [Command(c, line_of(block.start())) for c in _commands_in_text(block[3])]
        prose = prose.replace(block[0], "\n" * block[0].count("\n"))  # keep line numbers
    for span in SPAN.finditer(prose):
        code = " ".join(span[1].split())
        if STARTS.match(code):
            found += [Command(c, line_of(span.start())) for c in _commands_in_text(code)]
    return found


def recipe_commands(path: Path) -> list[Command]:
    """The commands in a YAML recipe's header comments (the lines before its first key)."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    return [Command(c, f"{_rel(path)}:1") for c in _commands_in_text("\n".join(header))]


def python_modes(path: Path) -> list[tuple[str, str]]:
    """``mode="NAME"`` in the Python examples of a page: (NAME, file:line)."""
    text = path.read_text()
    out = []
    for block in FENCE.finditer(text):
        if block[2].strip().lower() in ("python", "py"):
            for m in re.finditer(r"\bmode=[\"']([^\"']+)[\"']", block[3]):
                out.append((m[1], f"{_rel(path)}:{text.count(chr(10), 0, block.start(3) + m.start()) + 1}"))
    return out


ALL = [c for p in DOCS for c in doc_commands(p)] + [c for p in RECIPES for c in recipe_commands(p)]


# -- the tools ---------------------------------------------------------------------------
def _script(name: str):
    key = f"docs_scripts_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # registered: a script may register torch ops whose functions dynamo later looks up by module
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def tool(words: list[str]) -> tuple[str, object, list[str]]:
    """(tool name, its module, its arguments) for ``python -m X ...``, ``python DIR/X.py ...``, ``medusa-chat``."""
    if words[0] == "medusa-chat":
        return "infer.chat", importlib.import_module("infer.chat"), words[1:]
    if words[1] == "-m":
        return words[2], importlib.import_module(words[2]), words[3:]
    script = words[1]
    folder, name = script.split("/")[0], Path(script).stem
    assert (REPO / script).is_file(), f"no such script: {script}"
    if folder == "train":
        return f"train.{name}", importlib.import_module(f"train.{name}"), words[2:]
    return f"scripts/{name}.py", _script(name), words[2:]


def parse(parser: argparse.ArgumentParser, args: list[str], parse_args=None) -> argparse.Namespace:
    """``parser.parse_args(args)`` (or the tool's own ``parse_args``, which checks more); its
    error message (argparse exits) becomes the assertion."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_args(args) if parse_args is not None else parser.parse_args(args)
    except SystemExit:
        raise AssertionError(f"{parser.prog} refuses {shlex.join(args)!r}: {err.getvalue().strip()}") from None


def check_modes(name: str, ns: argparse.Namespace) -> None:
    from medusa.decoding.proposers.factory import MODES

    if getattr(ns, "mode", None) is not None:
        assert ns.mode in MODES, f"{name}: --mode {ns.mode} is not a mode ({', '.join(MODES)})"
    if name == "infer.bench" and ns.modes is not None:
        from medusa.bench.modes import parse_modes

        parse_modes(ns.modes)  # MedusaError names an unknown mode


def check_configs_paths(words: list[str]) -> None:
    """Every path under configs/ a command names exists, and a YAML or JSON one loads."""
    for word in words:
        value = word.split("=", 1)[-1]
        if value.startswith("configs/"):
            path = REPO / value
            assert path.exists(), f"{value} does not exist"
            if path.suffix in (".yaml", ".yml"):
                yaml.safe_load(path.read_text())
            elif path.suffix == ".json":
                json.loads(path.read_text())


def check_accelerate_config(path: str) -> None:
    """A launch config that accelerate loads; the DeepSpeed file it names exists and parses, and
    then the launch config leaves the precision to it (accelerate refuses both)."""
    from accelerate.commands.config.config_args import load_config_from_file

    assert (REPO / path).is_file(), f"{path} does not exist"
    load_config_from_file(str(REPO / path))
    data = yaml.safe_load((REPO / path).read_text())
    ds_file = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:
        assert (REPO / ds_file).is_file(), f"{path} names {ds_file}, which does not exist"
        json.loads((REPO / ds_file).read_text())
        assert "mixed_precision" not in data, f"{path}: with deepspeed_config_file, mixed_precision belongs in {ds_file}"


def check_tool(words: list[str]) -> None:
    name, module, args = tool(words)
    assert hasattr(module, "build_parser"), f"{name} has no build_parser()"
    parser = module.build_parser()
    if "--help" in args or "-h" in args:
        with pytest.raises(SystemExit) as exit_, contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
        assert exit_.value.code == 0
        return
    ns = parse(parser, args, getattr(module, "parse_args", None))  # argparse's own message for a bad flag
    if name in TRAIN_TOOLS:
        from medusa.config import parse_config

        parse_config(getattr(module, TRAIN_TOOLS[name]), args, parser)  # the YAML loads, every field checks
    check_modes(name, ns)


def check_accelerate(words: list[str]) -> None:
    from accelerate.commands.launch import launch_command_parser

    if len(words) == 2:  # prose naming the launcher ("`accelerate launch` sets ..."), not a command
        return
    ns = parse(launch_command_parser(), words[2:])
    if ns.config_file:
        check_accelerate_config(ns.config_file)
    script = ns.training_script
    check_tool(["python", *(["-m", script] if ns.module else [script]), *ns.training_script_args])


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def check_make(words: list[str]) -> None:
    targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
    for target in targets or ["setup"]:
        assert target in makefile_targets(), f"make {target}: no such target in the Makefile"
    for word in words[1:]:
        if word.startswith("ARGS=") and targets in (["bench"], ["chat"]):
            check_tool(["python", "-m", f"infer.{targets[0]}", *shlex.split(word[len("ARGS="):])])


def check(command: Command) -> None:
    # "[--private]": an optional flag, shown in brackets
    words = [w[1:-1] if w.startswith("[-") and w.endswith("]") else w for w in shlex.split(command.text)]
    check_configs_paths(words)
    if words[0] == "make":
        check_make(words)
    elif words[0] == "accelerate":
        check_accelerate(words)
    else:
        check_tool(words)


# -- tests -------------------------------------------------------------------------------
def test_the_docs_hold_commands_of_every_kind():
    """The reader finds the commands (a broken extraction would make the test below vacuous)."""
    starts = {c.text.split()[0] if c.text.startswith(("make", "accelerate")) else " ".join(c.text.split()[:3])
              for c in ALL}
    assert len(ALL) > 80
    assert {"make", "accelerate", "python -m infer.chat", "python -m infer.bench"} <= starts
    assert any(s.startswith("python scripts/") for s in starts) and any(s.startswith("python train/") for s in starts)
    readme = [c for c in ALL if c.where.startswith("README.md")]
    assert any("--config configs/train/your-model-eagle3.yaml" in c.text for c in readme)
    template = [c for c in ALL if c.where.startswith("configs/train/your-model-eagle3.yaml")]
    assert {c.text.split()[1] for c in template} >= {"launch", "train/generate_selfdistill.py", "scripts/export_heads.py"}


# Known failures on pages kept by their own authors: fix the command there, then drop its entry.
PENDING: dict[str, str] = {}  # page -> a command text known to fail there (an xfail until the page is fixed)


def _marks(command: Command):
    page = command.where.split(":")[0]
    if page in PENDING and PENDING[page] in command.text:
        return [pytest.mark.xfail(reason=f"{page} still says {PENDING[page]}", strict=False)]
    return []


@pytest.mark.parametrize("command", [pytest.param(c, marks=_marks(c), id=str(c)) for c in ALL])
def test_documented_command_parses(command):
    check(command)


@pytest.mark.parametrize("mode, where", [m for p in DOCS for m in python_modes(p)], ids=lambda x: str(x))
def test_python_examples_name_real_modes(mode, where):
    from medusa.decoding.proposers.factory import MODES

    assert mode in MODES, f"{where}: mode={mode!r} is not a mode ({', '.join(MODES)})"


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "accelerate").glob("*.yaml")), ids=_rel)
def test_launch_configs_load(path):
    check_accelerate_config(_rel(path))


def test_a_wrong_command_is_caught():
    """The checks can fail: a removed mode, a removed flag, a config that is not there, a
    training config that does not build, a make target that does not exist."""
    bad = ["python -m infer.bench --modes hf,eagle-hybrid", "python -m infer.bench --tree-sizes 4,8",
           "python -m infer.chat --mode eagle-hybrid",
           "python scripts/calibrate_tree.py --no-such-flag",
           "accelerate launch --config_file configs/accelerate/none.yaml train/train_heads.py",
           "accelerate launch train/train_heads.py --config configs/train/qwen2.5-7b-instruct.yaml --kind eagle --lora true",
           "make no-such-target"]
    for text in bad:
        with pytest.raises(Exception):  # noqa: B017 (AssertionError, MedusaError, ...: any refusal)
            check(Command(text, "test"))
