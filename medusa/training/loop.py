"""Training Medusa heads: one explicit loop over a frozen (or LoRA-tuned) target.

Read top to bottom: config -> data -> target and heads -> optional feature cache ->
optimizer and schedule -> loop (accumulate, clip, step, log, eval, checkpoint) -> heads
folder. ``accelerate`` provides the device, DDP and DeepSpeed; the loop is ours.

* Medusa-1 (default): the target is frozen, only the heads train. With ``cache_dir`` the
  target runs once over the data and epochs read its hidden states from disk.
* Medusa-2 (``lora: true``): the target trains too, through peft LoRA adapters. Its loss
  adds a KL term to the frozen original's next-token distribution (the original is the
  same model with adapters disabled), so the target keeps its own outputs while it learns
  to make the heads' job easier. The output then holds the tuned target as well.

Data order is a pure function of ``(seed, epoch, step)``, so ``resume`` from a checkpoint
reaches exactly the state an uninterrupted run would have.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from medusa.config import TrainConfig, to_dict
from medusa.decoding.hf import lm_logits
from medusa.errors import MedusaError
from medusa.models.checkpoint import atomic_file
from medusa.models.eagle import init_eagle_for
from medusa.models.heads import (
    CALIBRATION_NAME,
    MedusaHeads,
    base_model_name,
    heads_from_state,
    init_heads_for,
    load_heads,
    save_heads,
)
from medusa.models.target import DEFAULT_MODEL_ID, load_target
from medusa.training.data import DataSplits, Example, build_datasets
from medusa.training.eagle import eagle_loss, sequence_batch, sequences
from medusa.training.feature_cache import FeatureCache, build_cache, fingerprint, is_complete
from medusa.training.losses import frequent_tokens, head_weights, heads_loss, lm_distill_loss, shift_targets

log = logging.getLogger("medusa.training.loop")

CHECKPOINTS = "checkpoints"
LATEST = "latest"


# -- what gets trained ---------------------------------------------------------------------------

class HeadsTrainer(nn.Module):
    """The module handed to ``accelerator.prepare``: heads, plus the LoRA target for Medusa-2.

    Its forward takes a micro-batch and returns ``(loss, counts)``, so DDP and DeepSpeed see
    one module call per step. A frozen target is held by reference, outside the module,
    so it is neither wrapped, sharded nor saved.
    """

    def __init__(self, heads: MedusaHeads, target: nn.Module, cfg: TrainConfig, vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.cfg = cfg
        self.vocab = vocab  # [S] token ids the heads' softmax covers, None: all
        self.weights = head_weights(cfg.num_heads, cfg.head_weight_decay, cfg.head_weights)
        if cfg.lora:
            self.target = target  # trainable adapters inside
        else:
            self._frozen = (target,)

    def _target(self) -> nn.Module:
        return self.target if self.cfg.lora else self._frozen[0]

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # A vocabulary subset only makes training cheaper: evaluation scores the full
        # vocabulary, as decoding does.
        vocab = self.vocab if self.training else None
        if "eagle" in batch:  # whole cached sequences, unrolled by the eagle head
            return eagle_loss(self.heads, batch["eagle"], self.weights, vocab, self.cfg.feature_weight)
        if "hidden" in batch:  # from the feature cache
            return heads_loss(self.heads, batch["hidden"], batch["targets"], self.weights, self.cfg.distill, vocab)
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]  # [B, T] each
        target = self._target()
        with torch.no_grad():
            # The frozen original: for Medusa-2 the same model with its adapters off.
            if self.cfg.lora:
                with target.disable_adapter():
                    t_hidden, t_logits = run_target(target, ids, attn)
            else:
                t_hidden, t_logits = run_target(target, ids, attn)
            top_ids = top_logp = None
            if self.cfg.distill > 0:
                k = min(self.cfg.teacher_topk, t_logits.shape[-1])
                top, top_ids = t_logits.float().topk(k, dim=-1)  # [B, T, k]
                top_logp = top - torch.logsumexp(t_logits.float(), dim=-1, keepdim=True)
        if self.cfg.lora:
            hidden, logits = run_target(target, ids, attn)  # [B, T, H], [B, T, V] with grads
        else:
            hidden = t_hidden
        targets = shift_targets(ids, mask * attn, self.cfg.num_heads, top_ids, top_logp)
        loss, counts = heads_loss(self.heads, hidden.reshape(-1, hidden.shape[-1]), targets, self.weights,
                                  self.cfg.distill, vocab)
        if self.cfg.lora:
            keep = attn.bool()
            lm = lm_distill_loss(logits[keep], t_logits[keep])
            loss = loss + self.cfg.lm_loss_weight * lm
            counts["lm_kl"] = lm.detach().reshape(1)
        return loss, counts


def run_target(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` -> final normed hidden states ``[B, T, H]`` and logits ``[B, T, V]``."""
    out = model.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False)
    hidden = out.last_hidden_state
    return hidden, lm_logits(model, hidden)


# -- data order -----------------------------------------------------------------------------------

@dataclass
class Schedule:
    """Where a global optimizer step reads its data: pure arithmetic, hence resumable."""

    num_items: int
    per_micro: int  # items per micro-batch per process
    world: int
    accum: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.num_items // (self.per_micro * self.world * self.accum))

    def micro_batch(self, step: int, micro: int, rank: int) -> np.ndarray:
        epoch, within = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed + 1000003 * epoch)
        order = torch.randperm(self.num_items, generator=g).numpy()
        start = ((within * self.accum + micro) * self.world + rank) * self.per_micro
        idx = order[start: start + self.per_micro]
        if len(idx) < self.per_micro:  # fewer items than one global batch: wrap around
            idx = np.resize(order, start + self.per_micro)[start:]
        return idx


def collate(examples: list[Example], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, T]`` ids, attention mask and loss mask."""
    width = max(len(e) for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for b, e in enumerate(examples):
        ids[b, : len(e)] = torch.tensor(e.input_ids)
        attn[b, : len(e)] = 1
        mask[b, : len(e)] = torch.tensor(e.loss_mask)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": mask.to(device)}


class Batches:
    """Micro-batches for a rank, from sequences or from a feature cache."""

    def __init__(self, examples: list[Example], cache: FeatureCache | None, cfg: TrainConfig, world: int,
                 device: torch.device) -> None:
        self.examples, self.cache, self.cfg, self.device = examples, cache, cfg, device
        if cache is not None and cfg.kind == "eagle":
            self.items = sequences(cache)  # [S, 2] sequence bounds
            per = cfg.batch_size
        elif cache is not None:
            self.items = cache.positions(cfg.num_heads)
            per = cfg.positions_per_batch
        else:
            self.items = np.arange(len(examples))
            per = cfg.batch_size
        self.schedule = Schedule(len(self.items), per, world, cfg.grad_accum, cfg.seed)

    def get(self, idx: np.ndarray) -> dict[str, Any]:
        if self.cache is not None and self.cfg.kind == "eagle":
            return {"eagle": sequence_batch(self.cache, self.items[idx], self.device)}
        if self.cache is not None:
            hidden, targets = self.cache.batch(self.items[idx], self.cfg.num_heads, self.device)
            return {"hidden": hidden, "targets": targets}
        return collate([self.examples[i] for i in self.items[idx]], self.device)

    def train(self, step: int, micro: int, rank: int) -> dict[str, Any]:
        return self.get(self.schedule.micro_batch(step, micro, rank))

    def in_order(self, rank: int, world: int, limit: int) -> Iterator[tuple[dict[str, Any], bool]]:
        """Evaluation batches in fixed order, split over ranks, as ``(batch, counts)``.

        Every rank runs the same number of forwards (sharded ZeRO-3 parameters are gathered
        collectively); a rank past the end reruns batch 0 with ``counts=False``.
        """
        per = self.schedule.per_micro
        n_batches = math.ceil(len(self.items) / per)
        if limit > 0:
            n_batches = min(n_batches, limit)
        for b in range(rank, math.ceil(n_batches / world) * world, world):
            keep = b < n_batches
            b = b if keep else 0
            yield self.get(np.arange(b * per, min((b + 1) * per, len(self.items)))), keep


# -- optimizer and schedule --------------------------------------------------------------------

def make_optimizer(module: HeadsTrainer, cfg: TrainConfig) -> torch.optim.Optimizer:
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    lora_lr = cfg.lora_lr if cfg.lora_lr is not None else cfg.lr / 10
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        lr = cfg.lr if name.startswith("heads.") else lora_lr
        wd = cfg.weight_decay if p.ndim >= 2 else 0.0
        groups.setdefault((lr, wd), []).append(p)
    if not groups:
        raise MedusaError("nothing to train: no parameter requires a gradient")
    return torch.optim.AdamW([{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()],
                             betas=(0.9, 0.999), eps=1e-8)


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


# -- checkpoints ---------------------------------------------------------------------------------

def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().cpu() for n, p in module.named_parameters() if p.requires_grad}


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """AdamW state as flat tensors (safetensors) + its JSON-safe remainder."""
    sd = opt.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            tensors[f"{pid}.{key}"] = (val if torch.is_tensor(val) else torch.tensor(val)).contiguous().cpu()
    return tensors, {"param_groups": sd["param_groups"]}


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], extra: dict[str, Any]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, val in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = val
    opt.load_state_dict({"state": state, "param_groups": extra["param_groups"]})


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = output_dir / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = output_dir / CHECKPOINTS / pointer.read_text().strip()
    return path if (path / "trainer.json").is_file() else None


def save_checkpoint(accelerator: Any, module: nn.Module, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                    out: Path) -> Path:
    """Write ``checkpoints/step-N`` to a temporary folder, rename it into place, then move
    the ``latest`` pointer: a crash at any moment leaves the previous checkpoint usable."""
    from safetensors.torch import save_file

    root = out / CHECKPOINTS
    final = root / f"step-{step:07d}"
    deepspeed = accelerator.distributed_type.name == "DEEPSPEED"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root)) if accelerator.is_main_process else None
    if deepspeed:
        # ZeRO shards optimizer state over processes: DeepSpeed writes its own checkpoint.
        shared = [str(tmp)] if tmp is not None else [None]
        if accelerator.num_processes > 1:
            torch.distributed.broadcast_object_list(shared, src=0)
        accelerator.save_state(shared[0])
        # Every rank writes its own files (ZeRO shards, its RNG state) and save_state does not
        # wait for the others: rename the folder only once all of them are done.
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        assert tmp is not None
        unwrapped = accelerator.unwrap_model(module)
        if not deepspeed:
            save_file(trainable_state(unwrapped), tmp / "trainable.safetensors")
            tensors, extra = optimizer_tensors(opt)
            save_file(tensors, tmp / "optimizer.safetensors")
            (tmp / "optimizer.json").write_text(json.dumps(extra))
        (tmp / "trainer.json").write_text(json.dumps({"step": step, "config": to_dict(cfg)}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        with atomic_file(root / LATEST) as pointer:
            pointer.write_text(final.name)
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[: max(0, len(done) - cfg.keep_checkpoints)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, module: nn.Module, opt: torch.optim.Optimizer, path: Path) -> int:
    from safetensors.torch import load_file

    if accelerator.distributed_type.name == "DEEPSPEED":
        accelerator.load_state(str(path))
    else:
        unwrapped = accelerator.unwrap_model(module)
        state = load_file(path / "trainable.safetensors")
        missing = set(trainable_state(unwrapped)) - set(state)
        if missing:
            raise MedusaError(f"checkpoint {path} does not match this run (missing {sorted(missing)[:3]}): "
                              "resume with the config that wrote it")
        unwrapped.load_state_dict(state, strict=False)
        load_optimizer(opt, load_file(path / "optimizer.safetensors"), json.loads((path / "optimizer.json").read_text()))
    return int(json.loads((path / "trainer.json").read_text())["step"])


# -- logging ------------------------------------------------------------------------------------

def wandb_enabled(cfg: TrainConfig) -> bool:
    return cfg.wandb and os.environ.get("WANDB_MODE") != "disabled"


def start_wandb(accelerator: Any, cfg: TrainConfig, out: Path) -> None:
    """wandb through accelerate's tracker (the main process logs). Offline unless WANDB_MODE
    says otherwise: no login is guessed and no credential file is read."""
    mode = os.environ.get("WANDB_MODE", "offline")
    accelerator.init_trackers(cfg.wandb_project, config=to_dict(cfg),
                              init_kwargs={"wandb": {"name": cfg.run_name, "dir": str(out), "mode": mode}})


def summarise(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Summed counts -> per-head mean loss and top-1/top-5 accuracy (1-based head names)."""
    out: dict[str, float] = {}
    n = counts["n"].clamp(min=1)
    for k in range(len(n)):
        out[f"head{k + 1}/top1"] = float(counts["top1"][k] / n[k])
        out[f"head{k + 1}/top5"] = float(counts["top5"][k] / n[k])
        out[f"head{k + 1}/loss"] = float(counts["loss"][k] / n[k])
    return out


# -- the run ----------------------------------------------------------------------------------------

def train(cfg: TrainConfig) -> Path:
    """Run training as configured; returns the heads folder."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, cpu=cpu_only_multiprocess(),
                              log_with="wandb" if wandb_enabled(cfg) else None)
    align_cpu_deepspeed(accelerator)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    main = accelerator.is_main_process
    out = Path(cfg.output_dir)
    if main:
        (out / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    set_seed(cfg.seed)
    t0 = time.time()
    if main:
        log.info("accelerate: %d process(es), %s, %s", world, accelerator.distributed_type.name, device)

    # Target and data. Every process tokenises the same data the same way (deterministic).
    with whole_weights(accelerator):
        target, tokenizer = load_target(cfg.model, device=device, dtype=cfg.dtype,
                                        trust_remote_code=cfg.trust_remote_code)
    if cfg.chat_template:
        path = Path(cfg.chat_template)
        tokenizer.chat_template = path.read_text() if path.is_file() else cfg.chat_template
    splits: DataSplits = build_datasets(tokenizer, cfg.data, cfg.max_length, cfg.max_samples, cfg.eval_fraction,
                                        cfg.pack, cfg.data_seed, cfg.data_split, progress=main)
    if main:
        log.info("data: %d train / %d held-out sequences (%s)", len(splits.train), len(splits.eval), splits.stats.summary())

    # Heads train in fp32 (master weights); a shared projection stays the target's own.
    set_seed(cfg.seed)
    if cfg.init_heads:
        heads = load_heads(cfg.init_heads, target, device=device, dtype=torch.float32)
        if heads.config.kind != cfg.kind:
            raise MedusaError(f"init_heads {cfg.init_heads} holds {heads.config.kind} heads but kind is {cfg.kind}: "
                              "set kind to match")
        # calibrated for the old weights: recalibrate after training
        if cfg.kind == "eagle":
            heads.dynamic = {}
        else:
            heads.trees = {}
        heads.config.base_model = base_model_name(target)
        heads.set_draft_vocab(None)
        cfg.num_heads, cfg.num_layers, cfg.projection = (heads.config.num_heads, heads.config.num_layers,
                                                         heads.config.projection)
        if main:
            log.info("heads: starting from %s (%d heads x %d layers, %s projection)", cfg.init_heads,
                     heads.config.num_heads, heads.config.num_layers, heads.config.projection)
    elif cfg.kind == "eagle":
        heads = init_eagle_for(target, cfg.num_heads, base_model_name(target)).float()
    else:
        heads = init_heads_for(target, cfg.num_heads, cfg.num_layers, cfg.projection).float()
    if cfg.lora:
        target = attach_lora(target, cfg)
        heads.bind(target.get_output_embeddings())
    vocab = None
    if cfg.train_vocab > 0:
        seen = torch.tensor([t for ex in splits.train for t, m in zip(ex.input_ids, ex.loss_mask) if m])
        vocab = frequent_tokens(seen, cfg.train_vocab, heads.config.vocab_size).to(device)
    module = HeadsTrainer(heads, target, cfg, vocab)

    caches = {"train": None, "eval": None}
    if cfg.cache_dir:
        for split, examples in (("train", splits.train), ("eval", splits.eval)):
            if not examples:
                continue
            folder = Path(cfg.cache_dir) / split
            topk = min(cfg.teacher_topk, heads.config.vocab_size)
            fp = fingerprint(target, examples, topk)
            if not is_complete(folder, fp):
                bar = tqdm(total=sum(len(e) for e in examples) // world, desc=f"cache {split}", unit="tok",
                           disable=not main)
                build_cache(folder, lambda i, a: run_target(target, i, a), examples, heads.config.hidden_size,
                            topk, fp, rank, world, accelerator.wait_for_everyone, device,
                            cfg.cache_batch_tokens, bar.update)
                bar.close()
            caches[split] = FeatureCache.open(folder)
    train_data = Batches(splits.train, caches["train"], cfg, world, device)
    eval_data = Batches(splits.eval, caches["eval"], cfg, world, device) if splits.eval else None
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, int(cfg.num_epochs * train_data.schedule.steps_per_epoch))

    optimizer = make_optimizer(module, cfg)
    # The schedule is stepped by hand once per optimizer step (accelerate's wrapper would
    # step it once per process). It is built on the plain optimizer before DeepSpeed wraps
    # it: ZeRO keeps using the same param_groups, so the learning rates set here apply.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg))
    if accelerator.distributed_type.name == "DEEPSPEED":
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        # Our micro-batches are built by hand, not by a DataLoader: DeepSpeed counts each as 1.
        ds["train_micro_batch_size_per_gpu"] = 1
        ds["gradient_accumulation_steps"] = cfg.grad_accum
        ds["train_batch_size"] = cfg.grad_accum * world
        if ds.get("gradient_clipping") == "auto":
            ds["gradient_clipping"] = cfg.max_grad_norm
    module, optimizer = accelerator.prepare(module, optimizer)

    step = 0
    if cfg.resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            log.info("resume: no checkpoint in %s, starting fresh", out / CHECKPOINTS)
        else:
            step = load_checkpoint(accelerator, module, optimizer, ckpt)
            with warnings.catch_warnings():  # "scheduler stepped before optimizer": intended here
                warnings.simplefilter("ignore")
                for _ in range(step):
                    scheduler.step()
            log.info("resumed from %s at step %d", ckpt, step)
    last_good = latest_checkpoint(out)

    if wandb_enabled(cfg):
        start_wandb(accelerator, cfg, out)
    history = (out / "metrics.jsonl").open("a") if main else None

    def record(kind: str, values: dict[str, Any]) -> None:
        """One line per log/eval in output_dir/metrics.jsonl (and wandb)."""
        line = {"kind": kind, "step": step, **{k: round(v, 5) if isinstance(v, float) else v for k, v in values.items()}}
        log.info(json.dumps(line))
        history.write(json.dumps(line) + "\n")
        history.flush()
        accelerator.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)  # no-op without trackers

    eval_metrics: dict[str, float] = {}
    if eval_data is not None and cfg.eval_every and step == 0:
        eval_metrics = evaluate(module, eval_data, accelerator, cfg)  # the untrained baseline
        if main:
            record("eval", eval_metrics)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=not main, dynamic_ncols=True)
    while step < total:
        module.train()
        # Dropout (LoRA) draws depend only on the step: resumed runs replay them exactly.
        torch.manual_seed(cfg.seed * 7919 + step)
        sums: dict[str, torch.Tensor] = {}
        step_loss = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            batch = train_data.train(step, micro, rank)
            with accelerator.accumulate(module):
                loss, counts = module(batch)
                mean_loss = accelerator.reduce(loss.detach(), "mean")
                if not torch.isfinite(mean_loss):
                    bar.close()
                    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
                    raise MedusaError(f"loss became {mean_loss.item()} at step {step}; {where}: lower lr "
                                      "(or check the data) and rerun with --resume")
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(module.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += mean_loss / cfg.grad_accum
            for key, val in counts.items():
                sums[key] = sums.get(key, 0) + val.detach()
        scheduler.step()
        step += 1
        sums = {k: accelerator.reduce(v, "sum") for k, v in sums.items()}
        metrics = summarise(sums)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss.item():.3f}", **{
            f"h{k + 1}": f"{metrics[f'head{k + 1}/top1']:.2f}/{metrics[f'head{k + 1}/top5']:.2f}"
            for k in range(cfg.num_heads)})
        if main and (step % cfg.log_every == 0 or step == total):
            values = {"loss": step_loss.item(), "lr": scheduler.get_last_lr()[0], **metrics}
            if "lm_kl" in sums:
                values["lm_kl"] = float(sums["lm_kl"].sum() / world / cfg.grad_accum)
            record("train", values)
        if eval_data is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total):
            eval_metrics = evaluate(module, eval_data, accelerator, cfg)
            if main:
                record("eval", eval_metrics)
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            last_good = save_checkpoint(accelerator, module, optimizer, step, cfg, out)
    bar.close()

    final = finish(accelerator, module, tokenizer, cfg, out, step, eval_metrics, time.time() - t0)
    if history is not None:
        history.close()
    for tracker in accelerator.trackers:  # not end_training(): the process group stays for the caller
        tracker.finish()
    return final


def cpu_only_multiprocess() -> bool:
    """True for a multi-process DDP launch (`--multi_gpu`, the ddp config) on a machine with
    no accelerator: accelerate then needs ``cpu=True`` to run DDP over gloo, instead of
    falling back to independent single processes. DeepSpeed brings its own CPU backend."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    has_accel = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    return launched and not deepspeed and not has_accel


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


@torch.no_grad()
def evaluate(module: nn.Module, data: Batches, accelerator: Any, cfg: TrainConfig) -> dict[str, float]:
    module.eval()
    sums: dict[str, torch.Tensor] = {}
    sums = {k: torch.zeros(cfg.num_heads, device=accelerator.device) for k in ("n", "top1", "top5", "loss")}
    for batch, keep in data.in_order(accelerator.process_index, accelerator.num_processes, cfg.eval_batches):
        _, counts = module(batch)
        if keep:
            for key in sums:
                sums[key] += counts[key]
    sums = {k: accelerator.reduce(v, "sum") for k, v in sums.items()}
    module.train()
    return summarise(sums)


def attach_lora(target: nn.Module, cfg: TrainConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in target.named_modules()}
    missing = [m for m in cfg.lora_target_modules if m not in present]
    if missing:
        raise MedusaError(f"lora_target_modules {missing} are not in this model: pick from e.g. q_proj, v_proj, gate_proj")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")
    model = get_peft_model(target, lora)
    model.train()
    return model


def finish(accelerator: Any, module: nn.Module, tokenizer: Any, cfg: TrainConfig, out: Path, step: int,
           eval_metrics: dict[str, float], seconds: float) -> Path:
    """Write the heads (and a Medusa-2 target) into ``output_dir``."""
    accelerator.wait_for_everyone()
    unwrapped: HeadsTrainer = accelerator.unwrap_model(module)
    heads, target = unwrapped.heads, unwrapped._target()
    if accelerator.distributed_type.name == "DEEPSPEED":
        # ZeRO-3 partitions the module's parameters over the processes: gather them (a
        # collective; rank 0 receives the full state) and rebuild heads and target on CPU.
        full = accelerator.get_state_dict(module)
        if accelerator.is_main_process:
            with whole_weights(accelerator):  # zero.Init would wait for the other ranks' collectives
                heads, target = rebuild_on_cpu(full, unwrapped, cfg)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return out
    per_head = {f"head{k + 1}": {"top1": round(eval_metrics.get(f"head{k + 1}/top1", float("nan")), 4),
                                 "top5": round(eval_metrics.get(f"head{k + 1}/top5", float("nan")), 4)}
                for k in range(cfg.num_heads)}
    heads.config.extra = {
        "training_args": to_dict(cfg),
        "eval_accuracy": per_head,
        "accuracy_reference": "target argmax" if cfg.distill > 0 else "data token",
        "steps": step,
        "train_vocab": cfg.train_vocab or heads.config.vocab_size,
        "train_seconds": round(seconds, 1),
    }
    if cfg.lora:
        merged = target.merge_and_unload()
        merged.config.name_or_path = str(out / "target")
        target_dir = out / "target"
        merged.save_pretrained(target_dir, safe_serialization=True)
        tokenizer.save_pretrained(target_dir)
        heads.config.base_model = cfg.model or DEFAULT_MODEL_ID
        heads.config.extra["medusa2"] = {"target": "target", "note": "heads go with the LoRA-tuned target in ./target"}
    write_heads(heads, out)
    (out / "training_args.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    accelerator.wait_for_everyone()
    return out


def rebuild_on_cpu(state: dict[str, torch.Tensor], unwrapped: HeadsTrainer,
                   cfg: TrainConfig) -> tuple[nn.Module, nn.Module]:
    """Heads (and the LoRA-adapted target, merged later) rebuilt unpartitioned on CPU from
    the gathered state dict of a DeepSpeed run: ``heads.*`` and ``target.*`` keys."""
    target = unwrapped._target()
    if cfg.lora:
        dtype = next(unwrapped.target.parameters()).dtype  # partitioned parameters keep their dtype
        base, _ = load_target(cfg.model, device="cpu", dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        target = attach_lora(base, cfg)
        tuned = {k[len("target."):]: v.cpu() for k, v in state.items() if k.startswith("target.")}
        result = target.load_state_dict(tuned, strict=False)
        lost = [k for k in result.missing_keys if "lora_" in k]
        if lost or result.unexpected_keys:
            raise MedusaError(f"the gathered LoRA target does not match the model rebuilt for saving (missing {lost[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]}): report this with the launch command")
        target.eval()
    heads_state = {k[len("heads."):]: v.cpu().float() for k, v in state.items() if k.startswith("heads.")}
    heads = heads_from_state(unwrapped.heads.config, heads_state, target, device="cpu", dtype=torch.float32)
    return heads, target


def write_heads(heads: MedusaHeads, out: Path) -> None:
    """Place ``config.json`` + ``model.safetensors`` in ``out`` without touching its other
    contents (checkpoints, logs): saved to a sibling, then each file renamed in."""
    tmp = out.with_name(f".{out.name}-heads")
    shutil.rmtree(tmp, ignore_errors=True)
    save_heads(heads.float(), tmp)
    # Trees calibrated for the previous weights would be applied to the new ones: dropped
    # first, so no crash can leave them next to new weights (recalibrate after training).
    (out / CALIBRATION_NAME).unlink(missing_ok=True)
    os.replace(tmp / "model.safetensors", out / "model.safetensors")
    os.replace(tmp / "config.json", out / "config.json")
    shutil.rmtree(tmp, ignore_errors=True)
