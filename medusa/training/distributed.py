"""Where the one training loop meets accelerate's distributed backends (DDP on CPUs, DeepSpeed).

Everything here is about making a launch behave: the accelerator a run needs, a target
loaded whole under ZeRO-3, DeepSpeed's batch bookkeeping for hand-built micro-batches, and
the rank and world size of DeepSpeed on machines without GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def make_accelerator(cfg: Any, tracking: bool) -> Any:
    """The run's ``Accelerator`` (``tracking``: wandb through accelerate's trackers)."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, cpu=cpu_only_multiprocess(),
                              log_with="wandb" if tracking else None)
    align_cpu_deepspeed(accelerator)
    return accelerator


def configure_deepspeed(accelerator: Any, cfg: Any) -> None:
    """DeepSpeed's batch settings for our micro-batches (call before ``prepare``)."""
    if accelerator.distributed_type.name != "DEEPSPEED":
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    # Our micro-batches are built by the task's fetch, not counted by DeepSpeed: each is 1.
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.grad_accum * accelerator.num_processes
    if ds.get("gradient_clipping") == "auto":
        ds["gradient_clipping"] = cfg.max_grad_norm


def cpu_only_multiprocess() -> bool:
    """True for a multi-process DDP launch (`--multi_gpu`, the ddp config) on a machine with
    no accelerator: accelerate then needs ``cpu=True`` to run DDP over gloo, instead of
    falling back to independent single processes. DeepSpeed brings its own CPU backend."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    has_accel = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    return launched and not deepspeed and not has_accel


def cpu_threads_warning(device_type: str, threads: int, omp: str | None, cores: int, local_processes: int) -> str | None:
    """The warning for a CPU run left on one thread of several cores, else None.

    ``accelerate launch`` sets ``OMP_NUM_THREADS=1`` in each process when the variable is unset
    and the config does not say ``use_cpu`` (``configs/accelerate/single.yaml`` serves CPUs and
    GPUs alike), so a one-process CPU run silently uses one core of many."""
    per_process = cores // max(local_processes, 1)
    if device_type != "cpu" or threads != 1 or omp != "1" or per_process < 2:
        return None
    return (f"training on 1 CPU thread of {per_process} usable per process (OMP_NUM_THREADS=1, which "
            f"`accelerate launch` sets when it is unset): pass --num_cpu_threads_per_process {per_process} "
            f"to accelerate launch, or set OMP_NUM_THREADS={per_process}, to use them all")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextmanager
def whole_weights(accelerator: Any) -> Iterator[None]:
    """Load the target unpartitioned, also under ZeRO-3.

    accelerate registers its DeepSpeed config with transformers, whose ``from_pretrained``
    then partitions a ZeRO-3 model at load time (``zero.Init``): its weights read as empty
    ``[0]`` tensors outside DeepSpeed's hooks. A frozen Medusa-1 target runs outside the
    DeepSpeed engine (feature cache, teacher), so it must be whole; a Medusa-2 target is
    partitioned by ``accelerator.prepare`` instead (each process holds one full copy until then).
    """
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type.name == "DEEPSPEED" else None
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # registered again for everything after loading


def align_cpu_deepspeed(accelerator: Any) -> None:
    """DeepSpeed on a machine without GPUs: accelerate starts DeepSpeed's process group
    (gloo, via DeepSpeed's CPU accelerator) but, finding no GPU backend, records a single
    process, so every rank would act as rank 0 of 1. Take rank and world size from the
    process group that DeepSpeed actually started."""
    if accelerator.distributed_type.name != "DEEPSPEED" or not torch.distributed.is_initialized():
        return
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if accelerator.num_processes == world:
        return
    from accelerate.state import PartialState

    # Both singletons (their state is shared by every instance), so every helper sees the fix.
    for state in (accelerator.state, PartialState()):
        state.num_processes, state.process_index = world, rank
        state.local_process_index = int(os.environ.get("LOCAL_RANK", rank))
