"""The compiled verification pass on the CPU, saved per pass size so later processes load it.

Why: ``torch.compile`` traces the target's forward with dynamo in every process, even when
inductor's kernels are cached, and for a small model's forward that tracing alone costs tens of
seconds per pass size on a CPU, paid again for each of a tree mode's sizes at every start
(docs/compile.md#a-second-start-loads-instead-of-tracing). Here each size
is compiled ahead of time instead (``aot_compile``: one full graph, no graph breaks), saved
under ``~/.cache/medusa/compiled`` (``MEDUSA_CACHE``), and a later process loads it without
tracing (seconds).

What a saved graph assumes is in its file name, :func:`fingerprint`: torch, transformers and
Python, the CPU's architecture, vector ISA and feature flags, this package's traced code, the
model's class, config, dtype, attention and opaque modules, the linear kernels and the backend; then the
thread count (inductor's CPU kernels bake it in) and the pass size. Dynamo's guards on modules,
functions and constants cannot be saved, so a saved graph keeps only its guards on the
inputs' tensors and shapes (``keep_portable_guards_unsafe``) and the fingerprint stands in for
the rest. Weights stay inputs (read from the model at each call), so one graph serves every
model of the same architecture and config. The cache's capacity stays symbolic: a graph is
traced on a throwaway cache whose slot dimension is marked dynamic, and real passes run
unmarked (a loaded graph refuses marked inputs).

Where a size cannot be compiled this way (a graph break, a guard that cannot be saved) or a
saved graph refuses a pass's inputs, the pass falls back to ``torch.compile``'s per-process
tracing for good, with a warning; ``fallback`` says why.

``build=False`` (the engine's ``compile="auto"``) never compiles in the process: a size that is
saved runs its graph, any other runs eagerly, and a missing size is looked for again every
``RECHECK_S`` seconds, so the graphs a background build (medusa/decoding/passes/build.py, which
``Engine.build_passes`` and the chat start) saves are picked up while the process runs. Saved files are pickles this package
wrote itself into its own cache folder, never files from the Hub, each behind its sha256 digest,
checked before it is unpickled (``FRAMING``). A load touches its file, and
saving a new one deletes those no process loaded for ``STALE_DAYS`` (:func:`prune`), so the
files of old versions and configs do not pile up.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import random
import re
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from medusa.errors import MedusaError
from medusa.runtime import exact, opaque
from medusa.runtime import hf as kv
from medusa.runtime import kernels as packed
from medusa.runtime.files import atomic_file

# A saved file is the sha256 digest of the pickle, then the pickle: the digest is checked before
# anything is unpickled, so a file cut off or damaged on disk is compiled again, never run.
FRAMING = "sha256-then-pickle"
PREFIX, SLOTS = 4, 256  # the throwaway cache a graph is traced on: its contents do not matter
STALE_DAYS = 30  # a saved pass no process loaded for this long is deleted when another is saved
RECHECK_S = 5.0  # build=False: how often a missing size's file is looked for again


def fingerprint(model: PreTrainedModel, kernels: str, backend: str) -> str:
    """What a saved pass depends on besides its inputs' shapes, hashed (see the module doc)."""
    traced = b"".join(Path(m.__file__).read_bytes() for m in (kv, packed, exact))
    parts = {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "isa": torch.backends.cpu.get_cpu_capability(), "cpu": _cpu_flags(), "code": hashlib.sha256(traced).hexdigest(),
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": model.config.to_json_string(use_diff=False),
        "attention": str(getattr(model.config, "_attn_implementation", None)),
        "dtype": str(model.dtype), "kernels": kernels, "packing": packed.PACKING_VERSION, "backend": backend,
        "framing": FRAMING,
        # opaque norms and rotary (opaque.opaque_ops) move the rotary's buffers the graph reads
        "opaque": sum(isinstance(m, (opaque.OpaqueRMSNorm, opaque.OpaqueRotary)) for m in model.modules()),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), hashed: compiled kernels may use any of them, and a home
    folder shared by machines of several CPU generations must not hand one's kernels to another."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def example_pass(model: PreTrainedModel, rows: int, cache_arg: str | None = None,
                 layers: tuple[int, ...] | None = None) -> tuple:
    """The throwaway pass a size is compiled on: ``rows`` new tokens as a chain after a
    ``PREFIX``-token prefill, on a fresh ``SLOTS``-slot cache whose capacity is marked dynamic.
    Returns :func:`medusa.runtime.hf.forward`'s positional arguments (contents do not matter).
    ``layers``: the passes return these layers' inputs (EAGLE-3 features); the prefill asks for
    them too, so that transformers installs its hidden-state hooks eagerly (it does so on first
    use, under a lock dynamo cannot trace: a pass compiled first would not be one graph)."""
    dtype, device = model.dtype, model.get_output_embeddings().weight.device
    cache = kv.new_static_cache(model, SLOTS)
    ids = torch.zeros(1, PREFIX, dtype=torch.long, device=device)
    kv.forward(model, ids, torch.arange(PREFIX, device=device)[None], cache,
               kv.causal_mask(model, 0, PREFIX, dtype, device, SLOTS), cache_arg=cache_arg, layers=layers)
    depth = torch.arange(rows, device=device)
    ancestor = torch.ones(rows, rows, dtype=torch.bool, device=device).tril_()
    mask = kv.tree_attention_mask(model, PREFIX, ancestor, depth, dtype, SLOTS)
    kv.mark_capacity_dynamic(cache, mask)
    return model, ids.new_zeros(1, rows), (PREFIX + depth)[None], cache, mask


class SavedPasses:
    """:func:`medusa.runtime.hf.forward`, compiled once per pass size and saved to ``folder``
    (called like it). ``traced`` and ``loaded`` list the sizes this process compiled and the
    ones it loaded; ``fallback`` is None, or why passes went back to per-process tracing."""

    def __init__(self, model: PreTrainedModel, folder: Path, backend: str = "inductor",
                 kernels: str = "default", build: bool = True) -> None:
        self.folder, self.backend, self.build = Path(folder), backend, build
        self.options = kv.compile_options(model) if backend == "inductor" else {}
        self.key = fingerprint(model, kernels, backend)
        self.graphs: dict[Path, object] = {}  # by file: pass size and thread count
        self.traced: list[int] = []
        self.loaded: list[int] = []
        self.fallback: str | None = None
        self._traced_fn = None
        self._looked: dict[Path, float] = {}  # build=False: when a missing file was last looked for
        self.layers: tuple[int, ...] | None = None  # the passes return these layers' inputs (PassStrategy.use_features)

    def path(self, rows: int) -> Path:
        # inductor's CPU kernels bake in the thread count (and the graph guards on it)
        layers = "" if self.layers is None else "-L" + "_".join(map(str, self.layers))
        return self.folder / f"pass-{self.key}{layers}-t{torch.get_num_threads()}-{rows}.bin"

    def missing(self, sizes: list[int]) -> list[int]:
        """The pass ``sizes`` neither loaded here nor saved for this machine and thread count."""
        return [rows for rows in sizes if self.path(rows) not in self.graphs and not self.path(rows).is_file()]

    def lock_path(self) -> Path:
        """The file a background build of these passes holds while it runs (:func:`build_lock`)."""
        return self.folder / f"build-{self.key}-t{torch.get_num_threads()}.lock"

    def __call__(self, model, input_ids, position_ids, cache, mask, logits_rows=None, cache_arg=None, layers=None):
        if layers != self.layers:
            raise MedusaError(f"saved passes return layers {self.layers}, asked for {layers}: set them with use_features")
        if self.fallback is None:
            graph = self.graph(model, input_ids.shape[1], cache_arg)
            if graph is not None:
                try:
                    return graph(model, input_ids, position_ids, cache, mask, logits_rows=logits_rows,
                                 cache_arg=cache_arg, layers=layers)
                except RuntimeError as e:  # only a guard's refusal: anything else is the pass's own error
                    if "GuardManager check failed" not in str(e):
                        raise
                    self._fall_back(f"a saved pass graph refused this pass's inputs ({_guard_reason(e)})")
        if not self.build:  # never compiled here: a size not saved (yet) runs eagerly
            return kv.forward(model, input_ids, position_ids, cache, mask, logits_rows=logits_rows, cache_arg=cache_arg,
                              layers=layers)
        kv.mark_capacity_dynamic(cache, mask)  # per-process tracing: one graph per size, any capacity
        return self._traced()(model, input_ids, position_ids, cache, mask, logits_rows=logits_rows,
                              cache_arg=cache_arg, layers=layers)

    def graph(self, model: PreTrainedModel, rows: int, cache_arg: str | None):
        """The graph for passes of ``rows`` new tokens: already here, loaded, or compiled and
        saved now (called inside the engine's kernel scope, so packed layers trace as such).
        None once the pass has fallen back."""
        path = self.path(rows)
        if self.fallback is not None or path in self.graphs:
            return self.graphs.get(path)
        if not self.build:
            now = time.monotonic()
            if now - self._looked.get(path, -RECHECK_S) < RECHECK_S:
                return None
            self._looked[path] = now
        if path.is_file():
            try:
                self.graphs[path] = torch.compiler.load_compiled_function(io.BytesIO(_checked(path.read_bytes())))
                self.loaded.append(rows)
                _touch(path)  # in use: not stale (prune)
                return self.graphs[path]
            except Exception as e:  # noqa: BLE001 - any unreadable cache file is compiled again
                again = "compiling it again" if self.build else "running that size eagerly"
                warnings.warn(f"medusa: the saved pass {path} could not be loaded ({_first_line(e)}); {again}",
                              RuntimeWarning, stacklevel=2)
        if not self.build:
            return None
        try:
            graph = self._compile(model, rows, cache_arg)
        except Exception as e:  # noqa: BLE001 - dynamo's many error types: a graph break, an unsavable guard
            self._fall_back(f"the pass could not be compiled as one saved graph ({type(e).__name__}: {_first_line(e)})")
            return None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _save(graph, path)
            prune(self.folder)
            prune_nonces()
        except Exception as e:  # noqa: BLE001 - a full disk, a read-only cache, a backend that cannot serialize
            warnings.warn(f"medusa: the compiled pass for {rows} rows could not be saved to {path} ({_first_line(e)}); "
                          "this process uses it, the next compiles it again", RuntimeWarning, stacklevel=2)
        self.graphs[path] = graph
        self.traced.append(rows)
        return graph

    @torch.inference_mode()
    def _compile(self, model: PreTrainedModel, rows: int, cache_arg: str | None):
        compiler = torch.compile(kv.forward, backend=self.backend, fullgraph=True, dynamic=False,
                                 options={"guard_filter_fn": torch.compiler.keep_portable_guards_unsafe, **self.options})
        state = random.getstate()
        random.seed()  # prune_nonces: a key from fresh entropy, whatever the user seeded
        try:
            return compiler.aot_compile((example_pass(model, rows, cache_arg, self.layers),
                                         {"cache_arg": cache_arg, "layers": self.layers}))
        finally:
            random.setstate(state)  # the user's stream goes on where it was

    def _fall_back(self, reason: str) -> None:
        self.fallback = reason
        then = "traces its compiled passes in each process" if self.build else "runs its passes eagerly"
        warnings.warn(f"medusa: {reason}; this engine {then} from now on", RuntimeWarning, stacklevel=3)

    def _traced(self):
        if self._traced_fn is None:
            self._traced_fn = kv.compiled_forward(torch.device("cpu"), self.backend, self.options)
        return self._traced_fn


def prune_nonces(days: float = 1.0) -> list[Path]:
    """Delete the single-use entries the saved passes leave in inductor's cache. Torch cannot hash
    these graphs (opaque ops), so under ``aot_compile`` it keys their AOTAutograd entries by a
    nonce drawn from Python's ``random`` (folders named ``0.<digits>``): after the same seed (a
    script's ``set_seed``) two graphs drew the same key, and the second pass then loaded the
    first's entry (a wrong graph) or failed on its shape guards (``KeyError: 't4'``).
    ``_compile`` draws each nonce from fresh entropy, so no entry is ever looked up again."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return prune(Path(cache_dir()) / "aotautograd", days, pattern="0.*/*")


def prune(folder: Path, days: float = STALE_DAYS, pattern: str = "pass-*.bin") -> list[Path]:
    """Delete the saved passes (or other ``pattern``) in ``folder`` that no process wrote or
    loaded for ``days`` (a load touches its file); returns them. Each update of torch, transformers or this package,
    each model config and thread count leaves files under a fingerprint no process asks for
    again, ~5 MB per pass size for a small model. A file another process removes or replaces
    meanwhile is left alone; one pruned just before another process loads it is compiled again."""
    cutoff, gone = time.time() - days * 86400, []
    for file in folder.glob(pattern):
        try:
            if file.stat().st_mtime < cutoff:
                file.unlink()
                gone.append(file)
        except OSError:
            continue
    return gone


def _save(graph, path: Path) -> None:
    """The graph's pickle behind its digest (``FRAMING``), renamed into place whole."""
    with atomic_file(path) as tmp:
        graph.save_compiled_function(str(tmp))
        payload = tmp.read_bytes()
        tmp.write_bytes(hashlib.sha256(payload).digest() + payload)


def _checked(data: bytes) -> bytes:
    """The pickle of a saved file whose digest matches it (``FRAMING``), else a ValueError."""
    payload = data[32:]
    if len(data) < 32 or hashlib.sha256(payload).digest() != data[:32]:
        raise ValueError("its checksum does not match: the file is cut off or damaged")
    return payload


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only cache: its files are not pruned by this process either
        pass


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def _guard_reason(error: BaseException) -> str:
    """The failed guard's own words from dynamo's message (its ``verbose_code_parts``)."""
    parts = re.search(r"verbose_code_parts=\[(.*?)\]", str(error), re.S)
    return parts.group(1).strip()[:300] if parts else _first_line(error)


def build_lock(path: Path) -> int | None:
    """Take the lock file ``path`` for this process (None), or return the pid of the live
    process that holds it. A lock left by a process that died is taken over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = path.with_name(f"{path.name}.{os.getpid()}")
    mine.write_text(str(os.getpid()))  # linked in whole: no process ever reads a half-written lock
    try:
        for _ in range(2):
            try:
                os.link(mine, path)
                return None
            except FileExistsError:
                holder = lock_holder(path)
                if holder is not None:
                    return holder
                path.unlink(missing_ok=True)  # its process is gone
        return lock_holder(path)
    finally:
        mine.unlink(missing_ok=True)


def lock_holder(path: Path) -> int | None:
    """The pid written in the lock file ``path`` if that process is alive, else None."""
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return pid
    return pid
