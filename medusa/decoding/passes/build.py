"""Building saved CPU passes beside a running process (``compile="auto"``).

Compiling one pass size takes about a minute on a small CPU, so a process with
``compile="auto"`` compiles nothing itself: :func:`start_build` loads the sizes this machine has
saved and starts ``python -m medusa.decoding.passes.build`` at low priority for the others. That
process loads the same target (same dtype, linear kernels and thread count, so the same saved
files: medusa/decoding/passes/saved.py), compiles and saves each size, and exits; the running
engine picks the files up at its next generation that needs them. One build runs at a time per
model and thread count (a lock file); a second one says which process holds it and exits.
:func:`build_here` is the same build in the calling process (``python -m infer.precompile``,
whose parser, medusa/decoding/passes/build_args.py, this module's build process shares).

Exit codes of the module: 0 done (or another process is building), 1 a problem the user can
fix, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from medusa.decoding.passes.build_args import build_parser, parse_args, sizes_text
from medusa.decoding.passes.saved import build_lock, lock_holder
from medusa.decoding.passes.strategies import PassStrategy, kernel_scope, make_passes
from medusa.errors import MedusaError
from medusa.runtime.exact import is_exact, use_exact


@dataclass
class PassBuild:
    """What :func:`start_build` did. ``loaded``: the saved sizes, loaded now (in ``seconds``);
    ``missing``: the sizes not saved yet, which run eagerly until built; ``pid``: the process
    building them (started here when ``started``, else one found holding the build's lock),
    None when nothing is missing; ``log``: the build's output, when started here; ``skipped``:
    why none was started though sizes are missing (the machine has too little memory free)."""

    sizes: list[int]
    loaded: list[int]
    missing: list[int]
    seconds: float = 0.0
    pid: int | None = None
    started: bool = False
    log: Path | None = None
    process: subprocess.Popen | None = None
    skipped: str | None = None  # why no build was started for the missing sizes (too little memory)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for a build started here; its exit code (None: none started here)."""
        return None if self.process is None else self.process.wait(timeout)


# What a build needs besides its own copy of the weights: the compiler's working memory (inductor
# and the C++ compiler it runs), which does not grow much with the model.
BUILD_HEADROOM = 1 << 30


def available_memory() -> int | None:
    """The memory the kernel says can be allocated without swapping (``MemAvailable`` in
    /proc/meminfo, bytes); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_problem(model: torch.nn.Module, available: int | None) -> str | None:
    """Why a build process, which loads a second copy of ``model``, must not start now: its
    weights and buffers plus :data:`BUILD_HEADROOM` exceed the ``available`` bytes (None: not
    known, not refused)."""
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    need = weights + BUILD_HEADROOM
    if available is None or available >= need:
        return None
    return (f"the build loads a second copy of the target and needs about {need / 2**30:.1f} GiB, but "
            f"{available / 2**30:.1f} GiB are available")


def _source(passes: PassStrategy, source: str | None) -> str:
    """Where the build process loads the target from: ``source``, else the folder or Hub id
    the target was loaded from (a relative folder made absolute)."""
    source = source or getattr(passes.model, "name_or_path", "") or ""
    if not source:
        raise MedusaError("this target was not loaded from a folder or Hub id, so a build process cannot load it: "
                          "pass source=FOLDER (a folder the target was saved to), or precompile in this process")
    return str(Path(source).resolve()) if Path(source).is_dir() else source


def start_build(passes: PassStrategy, sizes: list[int], scope, source: str | None = None,
                trust_remote_code: bool = False, memory: Callable[[], int | None] = available_memory) -> PassBuild:
    """Load the saved ones of the pass ``sizes`` (in the kernel ``scope``) and start a background
    process, at low priority, that compiles and saves the others (:class:`PassBuild`). Nothing
    happens for passes that save nothing; a live build of these passes is left to finish; none
    starts when ``memory()`` (the bytes available) cannot hold a second copy of the target
    (``skipped`` says so: a 7B float32 target would take 28 GB more)."""
    if passes.saved is None:
        return PassBuild(list(sizes), [], [])
    missing = passes.missing(sizes)
    ready = [s for s in sizes if s not in missing]
    t0 = time.perf_counter()
    if ready:
        with scope:
            passes.warm(ready)
    build = PassBuild(list(sizes), ready, missing, time.perf_counter() - t0)
    if not missing:
        return build
    saved = passes.saved
    build.pid = lock_holder(saved.lock_path())
    if build.pid is not None:
        return build
    build.skipped = memory_problem(passes.model, memory())
    if build.skipped is not None:
        return build
    build.log = saved.folder / "precompile.log"
    saved.folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "medusa.decoding.passes.build", "--model", _source(passes, source),
           "--sizes", ",".join(map(str, missing)), "--kernels", passes.kernels,
           "--dtype", str(passes.model.dtype).removeprefix("torch."), "--threads", str(torch.get_num_threads()),
           "--exact", "on" if is_exact(passes.model) else "off", "--nice", "19"]
    cmd += ["--trust-remote-code"] if trust_remote_code else []
    with open(build.log, "a", encoding="utf-8") as out:
        build.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # outlives the process that started it
    build.pid, build.started = build.process.pid, True
    return build


def build_here(passes: PassStrategy, sizes: list[int], scope, label: str,
               out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Compile and save the pass ``sizes`` not saved yet, in this process, under the build's
    lock, saying what it does on ``out`` (errors on ``err``); the exit code (0: done, or another
    process holds the lock; 1: the passes could not be compiled as saved graphs)."""
    out, err = out or sys.stdout, err or sys.stderr
    saved = passes.saved
    if saved is None or not saved.build:
        raise MedusaError("only compile=True passes on a CPU are built and saved: load the engine with compile=True")
    todo = passes.missing(sizes)
    if not todo:
        print(f"every pass size of {label} asked for ({', '.join(map(str, sizes))}) is saved already", file=out, flush=True)
        return 0
    lock = saved.lock_path()
    holder = build_lock(lock)
    if holder is not None:
        print(f"another process (pid {holder}) is compiling these passes; its lock is {lock}", file=out, flush=True)
        return 0
    try:
        print(f"compiling pass {sizes_text(todo)} of {label} ({str(passes.model.dtype).removeprefix('torch.')}, "
              f"{passes.kernels} kernels, {torch.get_num_threads()} threads) into {saved.folder}", file=out, flush=True)
        t0 = time.perf_counter()
        with scope:
            passes.warm(todo, progress=lambda rows, s: print(f"  {rows} rows: {s:.1f} s", file=out, flush=True))
        if saved.fallback is not None:
            print(f"error: {saved.fallback}; nothing was saved for these sizes (decoding with compile=True still "
                  "traces them in each process)", file=err, flush=True)
            return 1
        plural = "s" if len(todo) != 1 else ""
        print(f"saved {len(todo)} pass size{plural} in {time.perf_counter() - t0:.1f} s", file=out, flush=True)
    finally:
        lock.unlink(missing_ok=True)
    return 0


def build_target(args: argparse.Namespace) -> int:
    """The build with the target loaded alone, its dtype, linear kernels and exact attention as
    ``args`` give them (:func:`~medusa.decoding.passes.build_args.parse_args` with ``--exact``):
    what the process :func:`start_build` starts runs, without heads or the machine plan."""
    from medusa.models.target import load_target

    model = load_target(args.model, device="cpu", dtype=args.dtype, trust_remote_code=args.trust_remote_code)[0]
    exact = use_exact(model, args.exact == "on", True)  # as the engine set it
    passes = make_passes(model, True, kernels=args.kernels, exact=exact)
    return build_here(passes, args.sizes, kernel_scope(model, args.kernels), args.model)


def main(argv: list[str] | None = None) -> int:
    """The build process :func:`start_build` starts (it passes everything the files depend on);
    ``python -m infer.precompile``'s parser, so one set of flags builds by hand and here."""
    parser = build_parser("python -m medusa.decoding.passes.build")
    args = parse_args(argv, parser)
    if args.exact is None:
        parser.error("the build process takes --exact with --model, --sizes, --kernels and --dtype "
                     "(python -m infer.precompile builds by hand)")
    if args.nice:
        os.nice(args.nice)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return build_target(args)
    except MedusaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
