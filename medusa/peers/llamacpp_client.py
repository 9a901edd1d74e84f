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

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from medusa.errors import MedusaError
from medusa.peers.sidecar import JsonWorker, chosen_python, clean_env, last_line, stamped
from medusa.runtime.files import atomic_file, cache_root

LLAMACPP_PACKAGE = "llama-cpp-python==0.3.36"
ENV = "MEDUSA_LLAMACPP_PYTHON"
_STAMP = ".medusa-llamacpp-installed"
_LOG = "install.log"
WORKER = Path(__file__).resolve().parent / "llamacpp_worker.py"


def default_venv() -> Path:
    return cache_root() / "llamacpp-venv"


def _stamped(venv: Path) -> bool:
    """Whether the venv's install finished, for this version (:func:`medusa.peers.sidecar.stamped`)."""
    return stamped(venv, _STAMP, LLAMACPP_PACKAGE)


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
                          f"{last_line(log.read_text(errors='replace'))}; log: {log}); install it by hand "
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
    return chosen_python(python, ENV, "llama_cpp") or ensure_venv(venv)


class LlamaCppWorker(JsonWorker):
    """One llama.cpp model in a subprocess: ``model`` an F32 GGUF file (see
    ``medusa.peers.gguf_f32``), ``lookup`` ``{"tokens": K, "ngram": N}`` for prompt-lookup
    drafts (None: plain decoding), ``n_threads`` llama.cpp's threads (pass torch's count)."""

    def __init__(self, model: str | Path, n_threads: int, lookup: dict[str, int] | None = None,
                 python: str | Path | None = None, n_ctx: int = 2048, startup_timeout: float = 300.0) -> None:
        settings = {"model": str(model), "n_ctx": n_ctx, "n_threads": n_threads, "lookup": lookup}
        super().__init__("llama.cpp", llamacpp_python(python), WORKER, settings, clean_env(), startup_timeout)
        self.version = self.ready.get("llama_cpp", "?")
        self.n_ctx = n_ctx

    def generate(self, prompt_ids: list[int], max_tokens: int, eos: list[int]) -> dict[str, Any]:
        """Greedy decode of one prompt: ``{"tokens", "seconds", "passes"}`` (see the worker)."""
        return self.request({"prompt_ids": list(prompt_ids), "max_tokens": int(max_tokens), "eos": sorted(eos)})
