"""Training Medusa heads (``kind: medusa``): the kind's training hooks (``medusa/models/kinds.py``).

Medusa-1 trains the heads on a frozen target's last hidden states, from the feature cache
(``cache_dir``: :func:`cached_batches`) or from the target run on each micro-batch. Medusa-2
(``lora: true``) trains the target's adapters too: the loss adds ``lm_loss_weight`` times the
KL of the tuned target's next-token distribution to the frozen original's (the same model
with its adapters disabled). The losses themselves are :mod:`medusa.training.losses`'.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from medusa.config import TrainConfig
from medusa.models.heads import MedusaHeads
from medusa.models.loader import init_heads_for
from medusa.training.batches import Batches
from medusa.training.feature_cache import FeatureCache, run_target
from medusa.training.losses import heads_loss, lm_distill_loss, shift_targets


def fresh_heads(target: nn.Module, cfg: TrainConfig, vocab: torch.Tensor | None = None) -> MedusaHeads:
    """New heads for ``target`` (``vocab`` unused: the heads share the target's projection)."""
    return init_heads_for(target, cfg.num_heads, cfg.num_layers, cfg.projection)


def cached_batches(cache: FeatureCache, cfg: TrainConfig, device: torch.device) -> Batches:
    """Micro-batches of ``positions_per_batch`` cached positions: hidden states and targets."""
    def fetch(pos: np.ndarray) -> dict[str, Any]:
        hidden, targets = cache.batch(pos, cfg.num_heads, device)
        return {"hidden": hidden, "targets": targets}

    return Batches(cache.positions(cfg.num_heads), cfg.positions_per_batch, fetch)


def batch_loss(heads: MedusaHeads, target: nn.Module, batch: dict[str, Any], cfg: TrainConfig, weights: list[float],
               vocab: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The heads' loss and counts over one micro-batch: cached positions, or sequences the
    target runs over now (with Medusa-2's KL to the frozen original added)."""
    if "hidden" in batch:  # from the feature cache
        return heads_loss(heads, batch["hidden"], batch["targets"], weights, cfg.distill, vocab)
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]  # [B, T] each
    with torch.no_grad():
        # The frozen original: for Medusa-2 the same model with its adapters off.
        if cfg.lora:
            with target.disable_adapter():
                t_hidden, t_logits = run_target(target, ids, attn)
        else:
            t_hidden, t_logits = run_target(target, ids, attn)
        top_ids = top_logp = None
        if cfg.distill > 0:
            k = min(cfg.teacher_topk, t_logits.shape[-1])
            top, top_ids = t_logits.float().topk(k, dim=-1)  # [B, T, k]
            top_logp = top - torch.logsumexp(t_logits.float(), dim=-1, keepdim=True)
    if cfg.lora:
        hidden, logits = run_target(target, ids, attn)  # [B, T, H], [B, T, V] with grads
    else:
        hidden = t_hidden
    targets = shift_targets(ids, mask * attn, cfg.num_heads, top_ids, top_logp)
    loss, counts = heads_loss(heads, hidden.reshape(-1, hidden.shape[-1]), targets, weights, cfg.distill, vocab)
    if cfg.lora:
        keep = attn.bool()
        lm = lm_distill_loss(logits[keep], t_logits[keep])
        loss = loss + cfg.lm_loss_weight * lm
        counts["lm_kl"] = lm.detach().reshape(1)  # summed over micro-batches and processes,
        counts["lm_batches"] = torch.ones_like(counts["lm_kl"])  # then divided by their number
    return loss, counts
