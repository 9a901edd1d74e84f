"""The one cache of machine measurements: ``cache_root()/plan.json``.

``{"schema": SCHEMA, "entries": {key: entry}}``. A key names what was measured and everything
the result depends on (:func:`key`): the kind of entry, the device and its fingerprint (CPU
model and vector/matrix flags, or GPU name and capability), the thread count, the torch and
transformers versions, the model's fingerprint, and what the entry needs besides. An entry is a
dict holding at least ``seconds`` (what measuring it cost).

Writes are atomic (a temporary file, then ``os.replace``) and merge under an exclusive
``fcntl`` lock on ``plan.json.lock``: each writer re-reads the file inside the lock and adds its
entry, so two processes filling the cache at once leave a valid file with both entries. A file
or entry that cannot be read (garbage, half written by a tool that did not write atomically,
another schema) is dropped with one warning line (the ``medusa.cache`` logger, as every damaged cache) and
measured again; it never stops a load. A file that cannot be written (a read-only or full disk,
an unusable lock path) is one warning per process: the load goes on with what it measured.

Timings taken while other processes used a good part of the CPUs are off (a pick flipped that
way once), so a timed entry records the share of the machine others used (the load probe,
:func:`others_load`, injectable for tests) and one taken while the machine was busy is measured
again by the next load that finds it idle.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from medusa.runtime.files import cache_root, cache_write_failed, log

SCHEMA = 1  # the one version of the file and its keys: bump it when an entry's meaning changes
FILE = "plan.json"
BUSY_SHARE = 0.25  # other processes used this much of the CPUs while an entry was timed: time it again
# /proc/stat counts in 10 ms ticks: over a window shorter than this, one tick of a kernel thread
# reads as a busy machine, so a shorter timing is never marked busy (its picks have wide margins)
JUDGED_S = 1.0
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    line = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    return line.split(":", 1)[-1].strip() or platform.processor() or platform.machine()


def device_key(device: torch.device) -> str:
    """The device and its fingerprint: GPU name and capability, or CPU model, torch's vector
    capability and the flags that decide fast dtypes."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    found = [f for f in _CPU_FLAGS if f in cpu_flags()] or [platform.machine()]
    return f"cpu {_cpu_name()} {torch.backends.cpu.get_cpu_capability()} {'+'.join(found)}"


def model_key(model: torch.nn.Module) -> str:
    """The target's fingerprint: its architecture and shape."""
    config = model.config.get_text_config()
    return f"{config.model_type} h{config.hidden_size} l{config.num_hidden_layers} v{config.vocab_size}"


def key(kind: str, device: torch.device, model: torch.nn.Module | None, *extra: str) -> str:
    """The one key scheme of every entry (see the module docstring)."""
    parts = [kind, device_key(device), f"threads {torch.get_num_threads()}", f"torch {torch.__version__}",
             f"transformers {transformers.__version__}"]
    return " | ".join(parts + ([model_key(model)] if model is not None else []) + list(extra))


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot (Linux's /proc/stat: steal
    counts as busy, idle and iowait as idle); None where it cannot be read."""
    try:
        ticks = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - sum(ticks[3:5])) / hz, sum(ticks) / hz


@contextlib.contextmanager
def others_load(share: list[float]):
    """Append to ``share`` the fraction of the machine's CPU time that *other* processes used
    while the block ran (this process's own threads excluded; nothing where /proc/stat is absent)."""
    before, own = _cpu_seconds(), time.process_time()
    yield
    after = _cpu_seconds()
    if before is not None and after is not None and after[1] > before[1]:
        others = (after[0] - before[0]) - (time.process_time() - own)
        share.append(max(0.0, others) / (after[1] - before[1]))


LoadProbe = Callable[[list[float]], contextlib.AbstractContextManager]


class PlanCache:
    """``plan.json`` under ``folder`` (default ``cache_root()``). ``load_probe``: how busy the
    machine was during a block (:func:`others_load`; tests pass their own)."""

    def __init__(self, folder: Path | None = None, load_probe: LoadProbe = others_load) -> None:
        self.path = Path(folder or cache_root()) / FILE
        self.load_probe = load_probe
        self._warned = False

    def _warn(self, what: str) -> None:
        if not self._warned:  # one line per load, however much of the file is bad
            log.warning("medusa: the cached %s is %s; dropped, measured again", self.path, what)
            self._warned = True

    def entries(self) -> dict[str, dict]:
        """Every readable entry (an unreadable file or entry: one warning, left out)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            self._warn(f"unreadable ({type(err).__name__})")
            return {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
            self._warn(f"not schema {SCHEMA}")
            return {}
        good = {k: v for k, v in data["entries"].items() if isinstance(v, dict) and "seconds" in v}
        if len(good) != len(data["entries"]):
            self._warn(f"{len(data['entries']) - len(good)} malformed entr{'y' if len(good) + 1 == len(data['entries']) else 'ies'}")
        return good

    def get(self, name: str, fields: tuple[str, ...] = ()) -> dict | None:
        """The entry ``name`` if present and holding ``fields``, else None."""
        entry = self.entries().get(name)
        if entry is not None and not all(f in entry for f in fields):
            self._warn(f"entry {name!r} lacks {', '.join(f for f in fields if f not in entry)}")
            return None
        return entry

    def busy_now(self, seconds: float = 0.25) -> bool:
        share: list[float] = []
        with self.load_probe(share):
            time.sleep(seconds)
        return bool(share) and share[0] >= BUSY_SHARE

    def measure(self, name: str, measure: Callable[[], dict], timed: bool = True) -> dict:
        """Run ``measure()`` (a dict), record its cost in ``seconds`` (and, for a timing taken
        while the machine was busy, ``busy_share``) and store it under ``name``."""
        share: list[float] = []
        t0 = time.perf_counter()
        with self.load_probe(share) if timed else contextlib.nullcontext():
            entry = measure()
        entry = {**entry, "seconds": round(time.perf_counter() - t0, 3)}
        if timed and share and share[0] >= BUSY_SHARE and entry["seconds"] >= JUDGED_S:
            entry["busy_share"] = round(share[0], 3)
        self.put(name, entry)
        return entry

    def put(self, name: str, entry: dict) -> None:
        """Merge ``entry`` into the file under the lock, atomically. A cache that cannot be
        written (a read-only or full disk, a lock path taken by a folder) is one warning per
        process and the load goes on with what it measured; no temporary file is left behind."""
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(FILE + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    entries = self.entries()
                    entries[name] = entry
                    tmp.write_text(json.dumps({"schema": SCHEMA, "entries": entries}, indent=1, sort_keys=True))
                    os.replace(tmp, self.path)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        except OSError as err:
            cache_write_failed(self.path, err)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
