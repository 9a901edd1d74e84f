"""The one training loop, for heads and draft models: setup -> loop -> save.

Read top to bottom: :func:`train` builds a :class:`Run` in :func:`setup` (accelerator,
target and data, the task's module and batches, optimizer and schedule, resume), runs
:func:`loop` (accumulate, clip, step, log, evaluate, checkpoint) and hands the trained module
back to its task to write. What differs between kinds (the module and its loss, its
batches, its metrics, its output folder) is behind the small :class:`Task` interface:
``heads_task.py`` (Medusa, EAGLE, Medusa-2 with LoRA) and ``draft_task.py``. ``accelerate`` provides
the device, DDP and DeepSpeed; ``transformers.get_scheduler`` the learning-rate schedule.

Data order is a pure function of ``(seed, epoch, step)`` (``batches.py``) and checkpoints
hold the weights, optimizer, schedule and RNG states (``checkpoints.py``), so ``resume``
reaches exactly the state an uninterrupted run would have.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import torch
from torch import nn

from medusa.config import TrainConfig, to_dict
from medusa.errors import MedusaError
from medusa.models.target import load_target, set_chat_template
from medusa.training.batches import Batches
from medusa.training.checkpoints import (
    CHECKPOINTS,
    claim_output,
    latest_checkpoint,
    load_checkpoint,
    resume_point,
    save_checkpoint,
    trainable_only,
)
from medusa.training.data import DataSplits, answer_token_ids, build_datasets
from medusa.training.distributed import (
    configure_deepspeed,
    cpu_threads_warning,
    make_accelerator,
    usable_cores,
    whole_weights,
)
from medusa.training.draft_task import DraftTask, DraftTrainConfig
from medusa.training.heads_task import HeadsTask

log = logging.getLogger("medusa.training.loop")

__all__ = ["TrainConfig", "DraftTrainConfig", "latest_checkpoint", "train"]


class Task(Protocol):
    """What differs between kinds of training. The module ``build`` returns takes a batch and
    returns ``(loss, counts)``: summable count tensors that ``summarise`` turns into metrics."""

    cfg: Any

    def build(self, accelerator: Any, target: nn.Module, splits: DataSplits) -> tuple[nn.Module, Batches, Batches | None]:
        ...

    def param_groups(self, module: nn.Module) -> list[dict[str, Any]]: ...

    def summarise(self, counts: dict[str, torch.Tensor]) -> dict[str, float]: ...

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]: ...

    def save(self, accelerator: Any, module: nn.Module, tokenizer: Any, step: int, total: int,
             evals: list[dict[str, Any]], seconds: float) -> Path: ...


TASKS: dict[type, type] = {TrainConfig: HeadsTask, DraftTrainConfig: DraftTask}


@dataclass
class Run:
    """Everything the loop reads and advances."""

    cfg: Any
    task: Task
    accelerator: Any
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_data: Batches
    eval_data: Batches | None
    total: int
    step: int
    out: Path
    tokenizer: Any
    t0: float
    history: IO[str] | None = None
    last_good: Path | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)


def train(cfg: TrainConfig | DraftTrainConfig) -> Path:
    """Train what ``cfg`` describes (heads or a draft model); returns the output folder."""
    run = setup(cfg)
    try:
        loop(run)
    finally:  # logs closed before the output is written (a draft's folder is swapped whole)
        if run.history is not None:
            run.history.close()
        for tracker in run.accelerator.trackers:  # not end_training(): the process group stays for the caller
            tracker.finish()
    return run.task.save(run.accelerator, run.module, run.tokenizer, run.step, run.total, run.evals,
                         time.time() - run.t0)


# -- setup ----------------------------------------------------------------------------------------

def setup(cfg: Any) -> Run:
    from accelerate.utils import set_seed

    task = TASKS[type(cfg)](cfg)
    accelerator = make_accelerator(cfg, tracking=wandb_enabled(cfg))
    main, out = accelerator.is_main_process, cfg.output_path()
    claim_output(out, cfg.resume, cfg.overwrite, main)
    if main:
        (out / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
        log.info("accelerate: %d process(es), %s, %s", accelerator.num_processes, accelerator.distributed_type.name,
                 accelerator.device)
        warning = cpu_threads_warning(accelerator.device.type, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"),
                                      usable_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if warning:
            log.warning(warning)
    set_seed(cfg.seed)
    t0 = time.time()
    target, tokenizer, splits = load_inputs(cfg, accelerator)
    set_seed(cfg.seed)
    module, train_data, eval_data = task.build(accelerator, target, splits)
    steps_per_epoch = train_data.schedule(accelerator.num_processes, cfg.grad_accum, cfg.seed).steps_per_epoch
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, int(cfg.num_epochs * steps_per_epoch))

    optimizer = make_optimizer(task, module, cfg)
    # The schedule is stepped by hand once per optimizer step (accelerate's wrapper would
    # step it once per process), so it is registered for checkpointing, not prepared. It is
    # built on the plain optimizer before DeepSpeed wraps it: ZeRO keeps using the same
    # param_groups, so the learning rates set here apply.
    scheduler = make_scheduler(optimizer, cfg, total)
    configure_deepspeed(accelerator, cfg)
    module, optimizer = accelerator.prepare(module, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    accelerator.register_save_state_pre_hook(trainable_only)
    step = resume(accelerator, module, cfg, out)
    if wandb_enabled(cfg):
        start_wandb(accelerator, cfg, out)
    history = (out / "metrics.jsonl").open("a") if main else None
    return Run(cfg, task, accelerator, module, optimizer, scheduler, train_data, eval_data, total, step, out,
               tokenizer, t0, history, latest_checkpoint(out))


def load_inputs(cfg: Any, accelerator: Any) -> tuple[nn.Module, Any, DataSplits]:
    """The target (whole, also under ZeRO-3) and the tokenised data. The first process of each
    machine tokenises into the rows cache while the others wait, then they read its rows (the
    cache is usually on a machine's own disk)."""
    main = accelerator.is_main_process
    with whole_weights(accelerator):
        target, tokenizer = load_target(cfg.model, device=accelerator.device, dtype=cfg.dtype,
                                        trust_remote_code=cfg.trust_remote_code)
    set_chat_template(tokenizer, cfg.chat_template)
    with accelerator.local_main_process_first():
        splits = build_datasets(tokenizer, cfg.data, cfg.max_length, cfg.max_samples, cfg.eval_fraction,
                                cfg.data_seed, cfg.data_split, progress=main, num_proc=cfg.num_proc,
                                cache_dir=cfg.data_cache_dir)
    if cfg.vocab_fill:
        splits.fill = answer_token_ids(tokenizer, cfg.vocab_fill)
    if main:
        log.info("data: %d train / %d held-out sequences (%s)", len(splits.train), len(splits.eval), splits.stats.summary())
    return target, tokenizer, splits


def make_optimizer(task: Task, module: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    groups = [g for g in task.param_groups(module) if g["params"]]
    if not groups:
        raise MedusaError("nothing to train: no parameter requires a gradient")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), eps=1e-8)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: Any, total: int) -> Any:
    """transformers' schedules: linear warmup over ``warmup_steps``, then cosine or linear
    decay to ``min_lr_ratio`` of each group's rate at ``total``, or constant. (The cosine one
    warms up as this loop always did, from ``1 / warmup_steps`` at step 0; transformers'
    linear and constant ones start from 0.)"""
    from transformers import get_scheduler

    if cfg.schedule == "constant" or cfg.min_lr_ratio >= 1:
        return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=cfg.warmup_steps)
    if cfg.schedule == "cosine":
        name, extra = "cosine_warmup_with_min_lr", {"min_lr_rate": cfg.min_lr_ratio}
    else:  # linear to a floor: a polynomial of power 1 (its floor is relative to optimizer.defaults["lr"] = lr)
        name, extra = "polynomial", {"lr_end": cfg.lr * cfg.min_lr_ratio, "power": 1.0}
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total,
                         scheduler_specific_kwargs=extra)


def resume(accelerator: Any, module: nn.Module, cfg: Any, out: Path) -> int:
    """The step to start from: 0, or the latest checkpoint's with ``resume`` (state restored)."""
    if not cfg.resume:
        return 0
    ckpt = resume_point(out)
    if ckpt is None:
        log.info("resume: no checkpoint in %s, starting fresh", out / CHECKPOINTS)
        return 0
    step = load_checkpoint(accelerator, module, ckpt)
    log.info("resumed from %s at step %d", ckpt, step)
    return step


# -- the loop -------------------------------------------------------------------------------------

def loop(run: Run) -> None:
    """Optimizer steps until ``total`` (or the time limit): log, evaluate, checkpoint."""
    from tqdm.auto import tqdm

    cfg, accelerator, main = run.cfg, run.accelerator, run.accelerator.is_main_process
    if run.eval_data is not None and run.step == 0:
        evaluate(run)  # the untrained baseline
    loader = run.train_data.loader(accelerator, cfg.grad_accum, cfg.seed, run.total, skip_steps=run.step)
    bar = tqdm(total=run.total, initial=run.step, desc="train", unit="step", disable=not main, dynamic_ncols=True)
    deadline = time.time() + cfg.max_minutes * 60 if cfg.max_minutes > 0 else math.inf
    first, batches = run.step, iter(loader)
    try:
        while run.step < run.total and (run.step == first or not out_of_time(accelerator, deadline)):
            lr = run.scheduler.get_last_lr()[0]  # this step's (train_step moves the schedule on)
            loss, metrics = train_step(run, batches)
            run.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", **run.task.postfix(metrics))
            if main and (run.step % cfg.log_every == 0 or run.step == run.total):
                record(run, "train", {"loss": loss, "lr": lr, **metrics})
            if run.eval_data is not None and cfg.eval_every and run.step % cfg.eval_every == 0:
                evaluate(run)
            if cfg.save_every and run.step % cfg.save_every == 0 and run.step < run.total:
                run.last_good = save_checkpoint(accelerator, run.step, cfg, run.out)
    finally:
        bar.close()
        loader.end()  # a loop left early leaves no active dataloader in accelerate's state
    if run.step < run.total and main:
        log.info("time limit of %g minutes reached after %d of %d steps", cfg.max_minutes, run.step, run.total)
    if run.eval_data is not None and (not run.evals or run.evals[-1]["step"] != run.step):
        evaluate(run)


def train_step(run: Run, batches: Iterator[Any]) -> tuple[float, dict[str, float]]:
    """One optimizer step over ``grad_accum`` micro-batches: the mean loss and the task's metrics."""
    cfg, accelerator, module = run.cfg, run.accelerator, run.module
    module.train()
    sums: dict[str, torch.Tensor] = {}
    step_loss = torch.zeros((), device=accelerator.device)
    for micro in range(cfg.grad_accum):
        batch = next(batches)
        # Dropout (LoRA) draws depend only on (step, micro-batch, rank), so a resumed run replays
        # them exactly. Seeded after fetching: a fresh data iterator draws from the global RNG.
        torch.manual_seed(((cfg.seed * 7919 + run.step) * 64 + micro) * 1024 + accelerator.process_index)
        with accelerator.accumulate(module):
            loss, counts = module(batch)
            mean_loss = accelerator.reduce(loss.detach(), "mean")
            if not torch.isfinite(mean_loss):
                where = f"the last good checkpoint is {run.last_good}" if run.last_good else "no checkpoint was written yet"
                raise MedusaError(f"loss became {mean_loss.item()} at step {run.step}; {where}: lower lr "
                                  "(or check the data) and rerun with --resume")
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                accelerator.clip_grad_norm_(module.parameters(), cfg.max_grad_norm)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        step_loss += mean_loss / cfg.grad_accum
        for key, val in counts.items():
            sums[key] = sums.get(key, 0) + val.detach()
    run.scheduler.step()
    return step_loss.item(), run.task.summarise({k: accelerator.reduce(v, "sum") for k, v in sums.items()})


def out_of_time(accelerator: Any, deadline: float) -> bool:
    """Past the deadline on any process: all stop at the same step."""
    if deadline == math.inf:
        return False
    late = torch.tensor(float(time.time() >= deadline), device=accelerator.device)
    return bool(accelerator.reduce(late, "sum") > 0)


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Held-out metrics, recorded in ``run.evals`` and ``metrics.jsonl``."""
    accelerator = run.accelerator
    run.module.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch, keep in run.eval_data.in_order(accelerator.process_index, accelerator.num_processes,
                                              run.cfg.eval_batches):
        _, counts = run.module(batch)
        for key, val in counts.items():
            sums[key] = sums.get(key, 0) + (val if keep else torch.zeros_like(val))
    run.module.train()
    metrics = run.task.summarise({k: accelerator.reduce(v, "sum") for k, v in sums.items()})
    run.evals.append({"step": run.step, **metrics})
    if accelerator.is_main_process:
        record(run, "eval", metrics)
    return metrics


# -- logging ----------------------------------------------------------------------------------------

def record(run: Run, kind: str, values: dict[str, Any]) -> None:
    """One line per log/eval in the output folder's metrics.jsonl (and wandb)."""
    line = {"kind": kind, "step": run.step,
            **{k: round(v, 5) if isinstance(v, float) else v for k, v in values.items()}}
    log.info(json.dumps(line))
    run.history.write(json.dumps(line) + "\n")
    run.history.flush()
    run.accelerator.log({f"{kind}/{k}": v for k, v in values.items()}, step=run.step)  # no-op without trackers


def wandb_enabled(cfg: Any) -> bool:
    return cfg.wandb and os.environ.get("WANDB_MODE") != "disabled"


def start_wandb(accelerator: Any, cfg: Any, out: Path) -> None:
    """wandb through accelerate's tracker (the main process logs). Offline unless WANDB_MODE
    says otherwise: no login is guessed and no credential file is read."""
    mode = os.environ.get("WANDB_MODE", "offline")
    accelerator.init_trackers(cfg.wandb_project, config=to_dict(cfg),
                              init_kwargs={"wandb": {"name": cfg.run_name, "dir": str(out), "mode": mode}})
