"""Run llama.cpp from this project: a dedicated venv, and a long-lived decoding worker in it.

llama-cpp-python ships as a source distribution that compiles llama.cpp on install (about 7
minutes on 2 cores), so it never joins this project's venv or its setup. The venv is created
once, by default under ``cache_root()/llamacpp-venv`` (``~/.cache/medusa/llamacpp-venv``), and
reused; a stamp file written last marks it finished, so a build that was cut off is started
again from an empty folder, never half-used. ``MEDUSA_LLAMACPP_PYTHON`` or ``python=`` names the
interpreter of an existing install instead. ``LlamaCppWorker`` starts ``llamacpp_worker.py``
under that interpreter, loads the GGUF file once, and decodes one prompt at a time, so model
loading stays out of any timing.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from medusa.errors import MedusaError
from medusa.runtime.files import atomic_file, cache_root, drop_cache_entry

LLAMACPP_PACKAGE = "llama-cpp-python==0.3.36"
ENV = "MEDUSA_LLAMACPP_PYTHON"
_STAMP = ".medusa-llamacpp-installed"
_LOG = "install.log"
WORKER = Path(__file__).resolve().parent / "llamacpp_worker.py"


def default_venv() -> Path:
    return cache_root() / "llamacpp-venv"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:200] if lines else "no output"


def _stamped(venv: Path) -> bool:
    """Whether the venv's install finished, for this version; a stamp that is damaged or names
    another version is dropped with one warning line (the venv is then built again)."""
    stamp = venv / _STAMP
    if not stamp.is_file():
        return False
    found = stamp.read_text(errors="replace").strip()
    if found == LLAMACPP_PACKAGE:
        return True
    drop_cache_entry(stamp, f"for {found[:40]!r}, not {LLAMACPP_PACKAGE}")
    return False


def _build(cmd: list[str], what: str, log: Path, every: float = 30.0) -> None:
    """Run ``cmd`` with its output appended to ``log``, printing the compile's progress (the
    ``[k/n]`` steps of its build) every ``every`` seconds; a failure is one line naming the log."""
    with log.open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        t0 = time.monotonic()
        while proc.poll() is None:
            try:
                proc.wait(timeout=every)
            except subprocess.TimeoutExpired:
                steps = re.findall(r"\[(\d+/\d+)\]", log.read_text(errors="replace")[-4000:])
                print(f"  {what}: {time.monotonic() - t0:.0f} s" + (f", compiling {steps[-1]}" if steps else ""),
                      file=sys.stderr)
    if proc.returncode != 0:
        raise MedusaError(f"llama-cpp-python could not be installed here ({what} failed: "
                          f"{_last_line(log.read_text(errors='replace'))}; log: {log}); install it by hand "
                          f"and set {ENV} to its python")


def ensure_venv(venv: str | Path | None = None) -> Path:
    """The python of a venv holding llama-cpp-python, building it on first use (minutes)."""
    # Resolved: a venv's scripts name the path it was made at, so a linked folder gets the real one.
    venv = (Path(venv) if venv is not None else default_venv()).resolve()
    python = venv / "bin" / "python"
    if _stamped(venv) and python.is_file():
        return python
    shutil.rmtree(venv, ignore_errors=True)  # whatever an unfinished build left
    venv.mkdir(parents=True)
    log = venv / _LOG
    print(f"creating the llama.cpp venv in {venv}: {LLAMACPP_PACKAGE} compiles llama.cpp (about 7 minutes "
          f"on 2 idle cores, once; seconds where pip kept the wheel it built before); log: {log}", file=sys.stderr)
    _build([sys.executable, "-m", "venv", str(venv)], "python -m venv", log)
    _build([str(python), "-m", "pip", "install", "-v", LLAMACPP_PACKAGE], f"pip install {LLAMACPP_PACKAGE}", log)
    with atomic_file(venv / _STAMP) as stamp:  # written last: a venv without it is built again
        stamp.write_text(LLAMACPP_PACKAGE + "\n")
    return python


def llamacpp_python(python: str | Path | None = None, venv: str | Path | None = None) -> Path:
    """The interpreter to run llama.cpp with: ``python``, else ``MEDUSA_LLAMACPP_PYTHON``, else
    the dedicated venv (built on first use)."""
    chosen = python or os.environ.get(ENV)
    if chosen:
        path = Path(chosen)
        if not path.is_file():
            raise MedusaError(f"llama.cpp python {path} does not exist: point {ENV} at a python that imports llama_cpp")
        return path
    return ensure_venv(venv)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the project's venv must not leak into the llama.cpp one
    return env


class LlamaCppWorker:
    """One llama.cpp model in a subprocess: ``model`` an F32 GGUF file (see
    ``medusa.models.gguf_f32``), ``lookup`` ``{"tokens": K, "ngram": N}`` for prompt-lookup
    drafts (None: plain decoding), ``n_threads`` llama.cpp's threads (pass torch's count)."""

    def __init__(self, model: str | Path, n_threads: int, lookup: dict[str, int] | None = None,
                 python: str | Path | None = None, n_ctx: int = 2048, startup_timeout: float = 300.0) -> None:
        self.python = llamacpp_python(python)
        settings = {"model": str(model), "n_ctx": n_ctx, "n_threads": n_threads, "lookup": lookup}
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llamacpp-worker-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self._proc = subprocess.Popen([str(self.python), str(WORKER), json.dumps(settings)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, env=worker_env(),
                                      cwd=tempfile.gettempdir())
        self.version = self._read(startup_timeout).get("llama_cpp", "?")

    def _read(self, timeout: float | None = None) -> dict[str, Any]:
        assert self._proc.stdout is not None
        if timeout is not None and not select.select([self._proc.stdout], [], [], timeout)[0]:
            self.close()
            raise MedusaError(f"llama.cpp did not start within {timeout:.0f} s: {self.log_tail()}; full log: {self.log_path}")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=30)
            raise MedusaError(f"the llama.cpp worker exited (code {self._proc.returncode}): {self.log_tail()}; "
                              f"full log: {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise MedusaError(f"llama.cpp failed: {reply['error']}")
        return reply

    def log_tail(self) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        return (errors[-1].strip() if errors else _last_line(text))[:300]

    def generate(self, prompt_ids: list[int], max_tokens: int, eos: list[int]) -> dict[str, Any]:
        """Greedy decode of one prompt: ``{"tokens", "seconds", "passes"}`` (see the worker)."""
        assert self._proc.stdin is not None
        request = {"prompt_ids": list(prompt_ids), "max_tokens": int(max_tokens), "eos": sorted(eos)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End the worker: EOF on its stdin ends its loop; killed if it is still there after 30 s."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc.wait()
        self._log.close()

    def __enter__(self) -> LlamaCppWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
