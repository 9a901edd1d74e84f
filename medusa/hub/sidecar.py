"""What the peers the bench runs beside the engine (vLLM, llama.cpp) share: a venv of their own,
finished when its stamp is written, and a long-lived worker process that speaks JSON lines.

Each peer pins packages this project's venv cannot hold (vLLM its own torch; llama-cpp-python a
compile of llama.cpp), so it lives in a venv under the cache root, created once. A stamp naming
the installed package is written last: a venv without it (an install cut off) or with another
version's is installed again, never half-used. The worker (``vllm_worker.py``,
``llamacpp_worker.py``) loads its model once and answers one JSON line per request on stdout,
``{"error": ...}`` when it fails; its stderr goes to a log file whose last error line is what a
failure says.
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


def clean_env(**defaults: str) -> dict[str, str]:
    """This process's environment for a peer's worker: ``defaults`` where unset, and no
    PYTHONPATH (it would shadow the peer venv's packages with this project's)."""
    env = dict(os.environ)
    for name, value in defaults.items():
        env.setdefault(name, value)
    env.pop("PYTHONPATH", None)
    return env


class JsonWorker:
    """A worker script run by a peer venv's ``python``: ``settings`` is its one argument (JSON),
    its first line says it is ready. ``name`` names it in errors; ``own_group`` starts it in a
    process group of its own, killed whole on close (vLLM's engine processes)."""

    def __init__(self, name: str, python: Path, script: Path, settings: dict[str, Any], env: dict[str, str],
                 startup_timeout: float, own_group: bool = False) -> None:
        self.name, self.python, self.own_group = name, python, own_group
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"{name.replace('.', '')}-worker-", suffix=".log",
                                                delete=False)
        self.log_path = Path(self._log.name)
        self._proc = subprocess.Popen([str(python), str(script), json.dumps(settings)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                      cwd=tempfile.gettempdir(), start_new_session=own_group)
        self.ready = self._read(startup_timeout)

    def _read(self, timeout: float | None = None) -> dict[str, Any]:
        assert self._proc.stdout is not None
        if timeout is not None and not select.select([self._proc.stdout], [], [], timeout)[0]:
            self.close()
            raise MedusaError(f"{self.name} did not start within {timeout:.0f} s: {self.log_tail()}; "
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
        """Send one request line and wait for its reply."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End the worker: EOF on its stdin ends its loop; after 30 s it is killed (its whole
        process group with ``own_group``)."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
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
