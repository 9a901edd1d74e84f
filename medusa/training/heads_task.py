"""Training Medusa and EAGLE heads: what the one loop (``loop.py``) trains for a ``TrainConfig``.

* Medusa-1 (default): the target is frozen, only the heads train. With ``cache_dir`` the
  target runs once over the data and epochs read its hidden states from disk.
* Medusa-2 (``lora: true``): the target trains too, through peft LoRA adapters. Its loss
  adds a KL term to the frozen original's next-token distribution (the original is the
  same model with adapters disabled), so the target keeps its own outputs while it learns
  to make the heads' job easier. The output then holds the tuned target as well.
* EAGLE (``kind: eagle``): one autoregressive head over the target's cached features,
  unrolled in training (``eagle_ttt.py``).
* EAGLE-3 (``kind: eagle3``): one head over several target layers fused, with its own draft
  vocabulary, seven steps unrolled (``eagle3_ttt.py``); the frozen target runs each
  micro-batch, or once over the data with ``cache_dir`` (the fused layers' inputs cached).
* Block (``kind: block``): a block of ``num_heads`` tokens drafted in one pass over the same
  fused layers (``block_train.py``); it reads the cache EAGLE-3 heads of those layers wrote.

What differs per kind lives in the kind's own training module, named by its entry in
``medusa/models/kinds.py``: ``fresh_heads`` (new heads for a target), ``loss`` (one micro-batch's
loss and counts) and ``cached_batches`` (micro-batches read from a feature cache); Medusa's are
in ``medusa_train.py``. This module builds, batches, saves and asks the kind's hooks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from medusa.config import TrainConfig, to_dict
from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads
from medusa.models.heads_config import CALIBRATION_NAME, base_model_name, save_heads
from medusa.models.kinds import kind, named
from medusa.models.loader import heads_from_state, load_heads
from medusa.models.target import DEFAULT_MODEL_ID, load_target
from medusa.training.batches import Batches, collate
from medusa.training.block_train import block_weights
from medusa.training.data import DataSplits, Example
from medusa.training.distributed import whole_weights
from medusa.training.feature_build import open_caches
from medusa.training.feature_cache import FeatureCache
from medusa.training.losses import frequent_tokens, head_weights

log = logging.getLogger("medusa.training.heads_task")


# -- what gets trained --------------------------------------------------------------------------

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
        self.weights = (block_weights(cfg.num_heads, cfg.block_decay) if kind(cfg.kind).block_trained
                        else head_weights(cfg.num_heads, cfg.head_weight_decay, cfg.head_weights))
        self._loss = named(kind(cfg.kind).loss)  # the kind's loss over one micro-batch
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
        return self._loss(self.heads, self._target(), batch, self.cfg, self.weights, vocab)


@dataclass
class HeadsTask:
    """Heads on a target: the module, its batches, its metrics and its output folder."""

    cfg: TrainConfig

    def build(self, accelerator: Any, target: nn.Module, splits: DataSplits) -> tuple[HeadsTrainer, Batches, Batches | None]:
        cfg, device = self.cfg, accelerator.device
        vocab = None
        if cfg.train_vocab > 0:
            seen = torch.tensor([t for ex in splits.train for t, m in zip(ex.input_ids, ex.loss_mask) if m])
            vocab = frequent_tokens(seen, cfg.train_vocab, target.get_output_embeddings().weight.shape[0],
                                    splits.fill).to(device)
        heads = self.heads(target, accelerator, vocab)
        if kind(cfg.kind).fused:
            vocab = None  # the heads' own lm_head is the draft vocabulary
        if cfg.lora:
            target = attach_lora(target, cfg)
            heads.bind(target.get_output_embeddings())
        layers = tuple(heads.feature_layers) if kind(cfg.kind).fused else None  # one cache for both kinds
        caches = open_caches(cfg, target, splits, accelerator, layers) if cfg.cache_dir else {}
        train = self.batches(splits.train, caches.get("train"), device)
        held_out = self.batches(splits.eval, caches.get("eval"), device) if splits.eval else None
        return HeadsTrainer(heads, target, cfg, vocab), train, held_out

    def heads(self, target: nn.Module, accelerator: Any, vocab: torch.Tensor | None = None) -> MedusaHeads:
        """Fresh heads for the target, or the ``init_heads`` folder's; fp32 (master weights),
        a shared projection staying the target's own. ``vocab``: eagle3's and block's draft vocabulary."""
        cfg = self.cfg
        if not cfg.init_heads:
            return named(kind(cfg.kind).fresh_heads)(target, cfg, vocab).float()
        heads = load_heads(cfg.init_heads, target, device=accelerator.device, dtype=torch.float32)
        if heads.config.kind != cfg.kind:
            raise MedusaError(f"init_heads {cfg.init_heads} holds {heads.config.kind} heads but kind is {cfg.kind}: "
                              "set kind to match")
        # calibrated for the old weights: recalibrate after training
        heads.forget_calibration()
        heads.config.base_model = base_model_name(target)
        heads.set_draft_vocab(None)
        cfg.num_heads, cfg.num_layers, cfg.projection = (heads.config.num_heads, heads.config.num_layers,
                                                         heads.config.projection)
        cfg.eagle_layout = heads.config.eagle_layout
        if accelerator.is_main_process:
            log.info("heads: starting from %s (%d heads x %d layers, %s projection)", cfg.init_heads,
                     heads.config.num_heads, heads.config.num_layers, heads.config.projection)
        return heads

    def batches(self, examples: list[Example], cache: FeatureCache | None, device: torch.device) -> Batches:
        """Micro-batches from sequences (the target runs each step), or read from the feature
        cache as the kind's ``cached_batches`` reads it (positions, or whole sequences)."""
        cfg = self.cfg
        if cache is not None:
            return named(kind(cfg.kind).cached_batches)(cache, cfg, device)
        return Batches(np.arange(len(examples)), cfg.batch_size, lambda ix: collate([examples[i] for i in ix], device))

    def param_groups(self, module: HeadsTrainer) -> list[dict[str, Any]]:
        """Heads at ``lr``, LoRA adapters at ``lora_lr``; weight decay on matrices only."""
        cfg = self.cfg
        groups: dict[tuple[float, float], list[nn.Parameter]] = {}
        lora_lr = cfg.lora_lr if cfg.lora_lr is not None else cfg.lr / 10
        for name, p in module.named_parameters():
            if p.requires_grad:
                lr = cfg.lr if name.startswith("heads.") else lora_lr
                groups.setdefault((lr, cfg.weight_decay if p.ndim >= 2 else 0.0), []).append(p)
        return [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]

    def summarise(self, counts: dict[str, torch.Tensor]) -> dict[str, float]:
        return summarise(counts)

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {f"h{k + 1}": f"{metrics[f'head{k + 1}/top1']:.2f}/{metrics[f'head{k + 1}/top5']:.2f}"
                for k in range(self.cfg.num_heads)}

    def save(self, accelerator: Any, module: nn.Module, tokenizer: Any, step: int, total: int,
             evals: list[dict[str, Any]], seconds: float) -> Path:
        return finish(accelerator, module, tokenizer, self.cfg, self.cfg.output_path(), step,
                      evals[-1] if evals else {}, seconds)


def summarise(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Summed counts -> per-head mean loss and top-1/top-5 accuracy (1-based head names),
    and Medusa-2's mean KL to the original target."""
    out: dict[str, float] = {}
    n = counts["n"].clamp(min=1)
    for k in range(len(n)):
        out[f"head{k + 1}/top1"] = float(counts["top1"][k] / n[k])
        out[f"head{k + 1}/top5"] = float(counts["top5"][k] / n[k])
        out[f"head{k + 1}/loss"] = float(counts["loss"][k] / n[k])
    if "lm_kl" in counts:
        out["lm_kl"] = float(counts["lm_kl"].sum() / counts["lm_batches"].sum().clamp(min=1))
    return out


# -- the output ---------------------------------------------------------------------------------

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
    """Write the heads (and a Medusa-2 target) into the ``output`` folder."""
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
