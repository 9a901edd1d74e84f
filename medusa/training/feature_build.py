"""Building the feature caches (:mod:`medusa.training.feature_cache`): the target run once over
the data, on one process or several, resumable, with the disk space checked first; and
:func:`open_caches`, which builds what is stale under a lock and opens both splits."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from medusa.errors import MedusaError
from medusa.runtime.files import atomic_file
from medusa.training.data import DataSplits, Example
from medusa.training.feature_cache import (
    BUILDING,
    FEATURES,
    LOCK,
    META,
    PREVIOUS,
    PROGRESS,
    Donor,
    FeatureCache,
    fingerprint,
    is_complete,
    run_layers,
    run_target,
    sequence_key,
    set_aside,
    target_kernels,
    weights_identity,
)

log = logging.getLogger("medusa.training.feature_cache")


def length_groups(order: list[int], lengths: np.ndarray, batch_tokens: int) -> Iterator[list[int]]:
    """Consecutive runs of ``order`` (sorted by length) whose padded size stays within
    ``batch_tokens``: little padding, bounded memory."""
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * lengths[order[j]] <= batch_tokens:
            j += 1
        yield order[i:j]
        i = j


@torch.no_grad()
def build_cache(folder: str | Path, target_fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                examples: list[Example], hidden_size: int, topk: int, fp: str, rank: int = 0, world: int = 1,
                barrier: Callable[[], None] = lambda: None, device: torch.device | str = "cpu",
                batch_tokens: int = 4096, progress: Callable[[int], None] | None = None,
                donors: list[Donor] = (), meta: dict | None = None, bfloat16: bool = False,
                mark_every_s: float = 30.0) -> int:
    """Run the target once over ``examples`` and store what the heads need.

    ``target_fn(input_ids [B, T], attention_mask [B, T]) -> (hidden [B, T, H], logits [B, T, V])``.
    Rank ``r`` of ``world`` writes sequences ``r, r + world, ...``; rank 0 creates the files
    and finally writes ``meta.json`` (with ``meta`` added); ``barrier`` synchronises the
    processes. A sequence one of ``donors`` holds is copied from it, not run. ``bfloat16``:
    store the hidden rows as bfloat16 bits (layer features outside float16's range). Returns
    the tokens this rank copied.

    A build cut off (a kill, a crash) resumes: once the arrays exist, ``building.json`` says so,
    and each rank records the sequences it has written (:class:`ProgressMarks`, every
    ``mark_every_s`` seconds); a later build of the same fingerprint keeps those rows and runs
    the rest. The free disk space is checked, and the arrays reserved, before they are allocated.
    """
    folder = Path(folder)
    lengths = np.array([len(ex) for ex in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    files = {"hidden": ((n, hidden_size), np.uint16 if bfloat16 else np.float16), "teacher_ids": ((n, topk), np.int32),
             "teacher_logp": ((n, topk), np.float16)}
    # Every rank checks (they see the same disk, or each its own): none waits on a rank that stopped.
    resumed = _resumable(folder, fp, files)
    if not resumed:
        check_free_space(folder, files, n, len(examples))
    barrier()
    if rank == 0 and not resumed:
        _create(folder, files, examples, offsets, fp)
    barrier()
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r+") for name in files}
    done = _done_sequences(folder) if resumed else set()
    mine = [e for e in range(rank, len(examples), world) if e not in done]
    marks = ProgressMarks(folder / f"{PROGRESS}{rank}", arrays, mark_every_s)
    todo, copied = _copy_known(arrays, examples, mine, offsets, donors)
    marks.add(sorted(set(mine) - set(todo)))
    if progress is not None and (copied or done):
        progress(copied + int(sum(lengths[e] for e in done if e % world == rank)))
    _run_target_over(arrays, target_fn, examples, sorted(todo, key=lambda i: lengths[i]), offsets, topk, device,
                     batch_tokens, progress, marks.add)
    marks.close()
    del arrays  # the maps closed before meta.json says the cache is whole
    barrier()
    if rank == 0:
        _finish(folder, {"fingerprint": fp, "tokens": n, "sequences": len(examples), "topk": topk,
                         "hidden_size": hidden_size, **(meta or {})})
    barrier()
    return copied


def _create(folder: Path, files: dict[str, tuple[tuple[int, ...], Any]], examples: list[Example],
            offsets: np.ndarray, fp: str) -> None:
    """Rank 0 of a fresh build: the feature arrays reserved, the token arrays written, and
    ``building.json`` (from now on a build cut off resumes)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META).unlink(missing_ok=True)
    for done in folder.glob(f"{PROGRESS}*"):
        done.unlink()
    for name, (shape, dtype) in files.items():
        _allocate(folder / f"{name}.npy", shape, dtype)
    np.save(folder / "tokens.npy", np.concatenate([np.asarray(ex.input_ids, dtype=np.int32) for ex in examples]))
    np.save(folder / "loss_mask.npy", np.concatenate([np.asarray(ex.loss_mask, dtype=np.uint8) for ex in examples]))
    np.save(folder / "offsets.npy", offsets)
    with atomic_file(folder / BUILDING) as tmp:  # the files above are whole: a killed build resumes
        tmp.write_text(json.dumps({"fingerprint": fp, "tokens": int(offsets[-1]), "sequences": len(examples)}) + "\n")


def _finish(folder: Path, meta: dict) -> None:
    """Rank 0, every rank's rows written: ``meta.json`` says the cache is whole; the resume
    records go."""
    with atomic_file(folder / META) as tmp:
        tmp.write_text(json.dumps(meta) + "\n")
    (folder / BUILDING).unlink(missing_ok=True)
    for marks in folder.glob(f"{PROGRESS}*"):
        marks.unlink()


class ProgressMarks:
    """A rank's record of the sequences it has written, for a build cut off to resume from:
    the rows are flushed to disk first, then their indices appended to its marker file, so a
    sequence marked done is on disk and one killed between the two is only run again. Marks are
    written at most every ``every_s`` seconds (flushing the maps is synchronous I/O) and on close."""

    def __init__(self, path: Path, arrays: dict[str, np.ndarray], every_s: float = 30.0) -> None:
        self.file, self.arrays, self.every_s = path.open("a"), arrays, every_s
        self.pending: list[int] = []
        self.last = time.monotonic()

    def add(self, sequences: list[int]) -> None:
        self.pending += sequences
        if time.monotonic() - self.last >= self.every_s:
            self.write()

    def write(self) -> None:
        for arr in self.arrays.values():
            arr.flush()
        if self.pending:
            self.file.write("".join(f"{e}\n" for e in self.pending))
            self.file.flush()
            os.fsync(self.file.fileno())
        self.pending, self.last = [], time.monotonic()

    def close(self) -> None:
        self.write()
        self.file.close()
        self.arrays = {}


def _resumable(folder: Path, fp: str, files: dict[str, tuple[tuple[int, ...], Any]]) -> bool:
    """Whether ``folder`` holds a build of fingerprint ``fp`` that was cut off (a kill, a crash):
    its arrays were all created at their sizes, so the sequences its progress markers name are
    kept and the others run."""
    try:
        started = json.loads((folder / BUILDING).read_bytes())
        if started.get("fingerprint") != fp:
            return False
        for name, (shape, dtype) in files.items():
            arr = np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            if arr.shape != shape or arr.dtype != dtype:
                return False
        return all((folder / f"{name}.npy").is_file() for name in ("tokens", "loss_mask", "offsets"))
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def _done_sequences(folder: Path) -> set[int]:
    """The sequences every rank's progress markers name (whole lines only: one cut by a kill is
    run again)."""
    done: set[int] = set()
    for marks in folder.glob(f"{PROGRESS}*"):
        text = marks.read_text(errors="replace")
        done.update(int(line) for line in text[: text.rfind("\n") + 1].split() if line.isdigit())
    return done


def check_free_space(folder: Path, files: dict[str, tuple[tuple[int, ...], Any]], tokens: int, sequences: int) -> None:
    """A one-line error before a cache larger than the free space of ``folder``'s disk is
    allocated: its arrays are memory-mapped, and a write into a sparse file the disk cannot hold
    ends the process with a bare "Bus error"."""
    need = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in files.values())
    need += tokens * 5 + (sequences + 1) * 8  # tokens, loss mask, offsets
    existing = folder if folder.exists() else next(p for p in folder.parents if p.exists())
    # the blocks an earlier build's arrays hold (sparse: fewer than their size) are freed when they are replaced
    held = sum(f.stat().st_blocks * 512 for f in folder.glob("*.npy")) if folder.is_dir() else 0
    free = shutil.disk_usage(existing).free + held
    if need > free:
        raise MedusaError(f"the feature cache {folder} needs {need / 1e9:.1f} GB and its disk has {free / 1e9:.1f} GB "
                          "free: free space there, set cache_dir to a folder on a larger disk, or train without "
                          "cache_dir (the target then runs every step)")


def _allocate(path: Path, shape: tuple[int, ...], dtype: Any) -> None:
    """An ``.npy`` file of ``shape`` whose blocks are reserved on disk now (``posix_fallocate``),
    so that a disk filled by something else meanwhile is an error here, not a "Bus error" in the
    middle of the build; where the filesystem cannot reserve, the file stays sparse."""
    np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
    if not hasattr(os, "posix_fallocate"):
        return
    with path.open("r+b") as f:
        size = f.seek(0, 2)
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                path.unlink()
                raise MedusaError(f"the feature cache {path.parent} does not fit on its disk (no space left for "
                                  f"{path.name}, {size / 1e9:.1f} GB): free space there, set cache_dir to a folder "
                                  "on a larger disk, or train without cache_dir") from None
            # EOPNOTSUPP and the like: a filesystem that cannot reserve; the free-space check stands


def _copy_known(arrays: dict[str, np.ndarray], examples: list[Example], mine, offsets: np.ndarray,
                donors: list[Donor]) -> tuple[list[int], int]:
    """Copy the rows of the sequences ``mine`` that a donor holds; return the others and the
    number of tokens copied."""
    todo, copied = [], 0
    for e in mine:
        key = sequence_key(examples[e].input_ids, examples[e].loss_mask) if donors else None
        donor = next((d for d in donors if key in d.rows), None)
        if donor is None:
            todo.append(e)
            continue
        s, L, src = int(offsets[e]), len(examples[e]), donor.rows[key]
        for name in FEATURES:
            arrays[name][s: s + L] = donor.arrays[name][src: src + L]
        copied += L
    return todo, copied


def _run_target_over(arrays: dict[str, np.ndarray], target_fn, examples: list[Example], order: list[int],
                     offsets: np.ndarray, topk: int, device, batch_tokens: int,
                     progress: Callable[[int], None] | None, finished: Callable[[list[int]], None]) -> None:
    """Run the target over the sequences ``order`` (sorted by length) in padded batches, write
    their rows and report each batch's sequences to ``finished``."""
    lengths = np.diff(offsets)
    for group in length_groups(order, lengths, batch_tokens):
        width = int(lengths[group[-1]])
        ids = torch.zeros((len(group), width), dtype=torch.long)
        attn = torch.zeros((len(group), width), dtype=torch.long)
        for b, e in enumerate(group):
            ids[b, : lengths[e]] = torch.tensor(examples[e].input_ids)
            attn[b, : lengths[e]] = 1
        hidden, logits = target_fn(ids.to(device), attn.to(device))  # [B, T, H], [B, T, V]
        logits = logits.float()
        top, top_ids = logits.topk(topk, dim=-1)  # [B, T, k]
        top_logp = top - torch.logsumexp(logits, dim=-1, keepdim=True)
        for b, e in enumerate(group):
            s, L = int(offsets[e]), int(lengths[e])
            rows = hidden[b, :L].cpu()
            arrays["hidden"][s: s + L] = (rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) if arrays["hidden"].dtype == np.uint16
                                          else rows.float().numpy().astype(np.float16))
            arrays["teacher_ids"][s: s + L] = top_ids[b, :L].cpu().numpy().astype(np.int32)
            arrays["teacher_logp"][s: s + L] = top_logp[b, :L].cpu().numpy().astype(np.float16)
        finished(group)
        if progress is not None:
            progress(int(lengths[group].sum()))




@contextlib.contextmanager
def build_lock(root: Path, main: bool) -> Iterator[None]:
    """Hold ``root/.build.lock`` (taken by the main process of a run; its other processes wait
    for it at the next barrier): a second run sharing ``cache_dir`` waits, saying so in one
    line, and then finds the caches the first one built, instead of writing the same files."""
    if not main:
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            log.warning("another run (pid %s) is building the feature caches in %s; waiting for it to finish",
                        holder, root)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def open_caches(cfg: Any, target: nn.Module, splits: DataSplits, accelerator: Any,
                layers: tuple[int, ...] | None = None) -> dict[str, FeatureCache]:
    """The feature caches of both splits in ``cfg.cache_dir``, built by running the target
    once where missing. Heads and draft training compute the same fingerprint, so the same
    data settings and ``cache_dir`` share one cache. A rebuild (other data) copies every
    sequence the outdated caches of the same weights hold and runs the target over the rest.
    ``layers``: cache the inputs of these layers (EAGLE-3) instead of the final hidden states."""
    vocab, hidden_size = target.get_output_embeddings().weight.shape
    layer_list = None if layers is None else [int(i) for i in layers]  # as meta.json records them
    if layers is not None:
        hidden_size *= len(layers)
        target_fn = functools.partial(run_layers, target, layers)
    else:
        target_fn = functools.partial(run_target, target)
    topk = min(cfg.teacher_topk, vocab)
    root, weights = Path(cfg.cache_dir), weights_identity(target)
    wanted = [(split, ex, fingerprint(target, ex, topk, weights, layers)) for split, ex in
              (("train", splits.train), ("eval", splits.eval)) if ex]
    with build_lock(root, accelerator.is_main_process):
        accelerator.wait_for_everyone()  # every process decides what is stale once the lock is held
        return _open_caches(cfg, target, target_fn, accelerator, root, weights, wanted, topk, hidden_size, layer_list)


def _open_caches(cfg: Any, target: nn.Module, target_fn, accelerator: Any, root: Path, weights: str, wanted: list,
                 topk: int, hidden_size: int, layer_list: list[int] | None) -> dict[str, FeatureCache]:
    """:func:`open_caches` under the build lock: build the stale splits, open all of them."""
    from tqdm.auto import tqdm

    caches: dict[str, FeatureCache] = {}
    world = accelerator.num_processes
    stale = [split for split, _, fp in wanted if not is_complete(root / split, fp)]
    if stale and accelerator.is_main_process:
        for split in stale:
            set_aside(root / split)
    accelerator.wait_for_everyone()
    # the outdated caches, and a split that is up to date (a sequence may change splits)
    donors = Donor.find([root / (split + PREVIOUS) for split in ("train", "eval")]
                        + [root / split for split, _, _ in wanted if split not in stale], weights, topk, hidden_size,
                        layer_list)
    for split, examples, fp in wanted:
        folder = root / split
        if split in stale:
            bar = tqdm(total=sum(len(e) for e in examples) // world, desc=f"cache {split}", unit="tok",
                       disable=not accelerator.is_main_process)
            with target_kernels(cfg.cache_kernels, target):
                build_cache(folder, target_fn, examples, hidden_size, topk, fp, accelerator.process_index, world,
                            accelerator.wait_for_everyone, accelerator.device, cfg.cache_batch_tokens, bar.update,
                            donors, {"weights": weights, "layers": layer_list}, bfloat16=layer_list is not None)
            bar.close()
        caches[split] = FeatureCache.open(folder)
    accelerator.wait_for_everyone()
    if stale and accelerator.is_main_process:  # every split is built: the outdated caches go
        for split in ("train", "eval"):
            shutil.rmtree(root / (split + PREVIOUS), ignore_errors=True)
    return caches
