"""What the peers the bench runs beside the engine (vLLM, llama.cpp) share: a venv of their own,
finished when its stamp is written, and a long-lived worker process that speaks JSON lines.

Each peer pins packages this project's venv cannot hold (vLLM its own torch; llama-cpp-python a
compile of llama.cpp), so it lives in a venv under the cache root, created once. A stamp naming
the installed package is written last: a venv without it (an install cut off) or with another
version's is installed again, never half-used. The worker (``vllm_worker.py``,
``llamacpp_worker.py``) loads its model once and answers one JSON line per request on stdout,
``{"error": ...}`` when it fails; its stderr goes to a log file whose last error line is what a
failure says. A request has a time limit (a hung worker is stopped, one line), a worker that died
is one line at the next request, a worker exits when the process that started it dies, and it
sees only an allow-listed part of the environment (no tokens).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from medusa.errors import MedusaError
from medusa.runtime.files import drop_cache_entry


def last_line(text: str, skip: str | None = None) -> str:
    """The last non-empty line of ``text`` (at most 200 characters), lines holding ``skip`` left out."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and (skip is None or skip not in ln)]
    return lines[-1].strip()[:200] if lines else "no output"


def stamped(venv: Path, stamp_name: str, package: str) -> bool:
    """Whether ``venv``'s install of ``package`` finished; a stamp that is damaged or names
    another version is dropped with one warning line (the install then runs again)."""
    stamp = venv / stamp_name
    if not stamp.is_file():
        return False
    found = stamp.read_text(errors="replace").strip()
    if found == package:
        return True
    drop_cache_entry(stamp, f"for {found[:40]!r}, not {package}")
    return False


def chosen_python(python: str | Path | None, env_var: str, module: str) -> Path | None:
    """``python``, else ``$env_var``, as a path that must exist (None when neither is set)."""
    chosen = python or os.environ.get(env_var)
    if not chosen:
        return None
    path = Path(chosen)
    if not path.is_file():
        raise MedusaError(f"{path} does not exist: point {env_var} at a python that imports {module}")
    return path


# What a peer's worker inherits of this process's environment: what finding programs, files,
# locales, thread counts, devices and offline caches takes, and the peers' own settings; nothing
# else (a Hugging Face token, cloud keys), and no PYTHONPATH (it would shadow the peer venv's
# packages with this project's).
_ENV_NAMES = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TEMP", "TMP",
              "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "MEDUSA_CACHE", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
              "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM"}
_ENV_PREFIXES = ("LC_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "CUDA_", "NVIDIA_", "VLLM_", "GGML_", "LLAMA_")
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


def clean_env(**defaults: str) -> dict[str, str]:
    """The environment of a peer's worker: the allow-listed part of this process's (names in
    ``_ENV_NAMES`` or starting with ``_ENV_PREFIXES``, never one that names a secret, such as
    ``VLLM_API_KEY``), and ``defaults`` where unset."""
    env = {name: value for name, value in os.environ.items()
           if (name in _ENV_NAMES or name.startswith(_ENV_PREFIXES))
           and not any(word in name.upper() for word in _SECRET_WORDS)}
    for name, value in defaults.items():
        env.setdefault(name, value)
    return env


class JsonWorker:
    """A worker script run by a peer venv's ``python``: ``settings`` is its one argument (JSON,
    with ``parent``, this process's pid, added: the worker exits when this process dies), its
    first line says it is ready. ``name`` names it in errors; ``own_group`` starts it in a
    process group of its own, killed whole on close (vLLM's engine processes). A request not
    answered within ``request_timeout`` seconds (None: no limit) stops the worker and is one line."""

    def __init__(self, name: str, python: Path, script: Path, settings: dict[str, Any], env: dict[str, str],
                 startup_timeout: float, own_group: bool = False, request_timeout: float | None = 900.0) -> None:
        self.name, self.python, self.own_group, self.request_timeout = name, python, own_group, request_timeout
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"{name.replace('.', '')}-worker-", suffix=".log",
                                                delete=False)
        self.log_path = Path(self._log.name)
        settings = {**settings, "parent": os.getpid()}
        self._proc = subprocess.Popen([str(python), str(script), json.dumps(settings)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                      cwd=tempfile.gettempdir(), start_new_session=own_group)
        self.ready = self._read(startup_timeout, "start")

    def _read(self, timeout: float | None, doing: str) -> dict[str, Any]:
        assert self._proc.stdout is not None
        if timeout is not None and not select.select([self._proc.stdout], [], [], timeout)[0]:
            self.close(wait=0)
            raise MedusaError(f"{self.name} did not {doing} within {timeout:.0f} s and was stopped: {self.log_tail()}; "
                              f"full log: {self.log_path}")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=30)
            raise MedusaError(f"the {self.name} worker exited (code {self._proc.returncode}): {self.log_tail()}; "
                              f"full log: {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise MedusaError(f"{self.name} failed: {reply['error']}")
        return reply

    def log_tail(self) -> str:
        """The worker log's last error line (else its last line), for a one-line error."""
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        return (errors[-1].strip() if errors else last_line(text))[:300]

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request line and wait for its reply (at most ``request_timeout`` seconds)."""
        assert self._proc.stdin is not None
        try:
            if self._proc.poll() is not None:
                raise BrokenPipeError
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: its stdin was closed by an earlier stop
            code = self._proc.wait(timeout=30)
            raise MedusaError(f"the {self.name} worker is not running (it exited with code {code} after its last "
                              f"request): {self.log_tail()}; full log: {self.log_path}; start the bench again") from None
        return self._read(self.request_timeout, "answer")

    def close(self, wait: float = 30) -> None:
        """End the worker: EOF on its stdin ends its loop; after ``wait`` seconds it is killed
        (its whole process group with ``own_group``)."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self._proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                if not self.own_group:
                    self._proc.kill()
        if self.own_group:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # the session this worker leads
            except (ProcessLookupError, PermissionError):
                pass
        self._proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
