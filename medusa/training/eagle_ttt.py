"""Training EAGLE heads on the feature cache, with training-time test (TTT).

A training sequence is one cached conversation: the target's features ``f_p`` ``[T, H]``,
its tokens ``x_p`` and its top-k distribution at every position. Step 0 feeds the true
pairs ``(f_p, x_{p+1})`` with causal attention and predicts ``f_{p+1}``; its loss is the KL
from the target's distribution at ``p + 1`` (over ``x_{p+2}``) to the head's, plus a small
regression of the predicted feature onto the true one.

Decoding drafts deeper on the head's *own* predictions, so step ``j`` (``j = 1 ..
num_heads - 1``) replays that: the pair at ``p`` carries the feature step ``j - 1``
predicted for ``p`` (its row ``p - 1``), and attends, as it would at draft depth ``j + 1``,
to the true pairs up to ``p - j`` and to the one pair of each earlier step on its own
chain (step ``i`` at position ``p - j + i``). All steps share one KV cache; the mask
selects those keys. Rows whose chain would start before the sequence are not scored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from medusa.config import TrainConfig
from medusa.models.eagle_heads import EagleHeads, additive_mask, init_eagle_for
from medusa.models.heads_config import base_model_name
from medusa.training.batches import Batches
from medusa.training.feature_cache import FeatureCache
from medusa.training.losses import add_counts, soft_cross_entropy, teacher_in_vocab, vocab_index


def sequences(cache: FeatureCache) -> np.ndarray:
    """``[S, 2]`` start and end of every cached sequence long enough to train on (> 2 tokens)."""
    offsets = np.load(cache.folder / "offsets.npy", allow_pickle=False)
    bounds = np.stack([offsets[:-1], offsets[1:]], axis=1)
    return bounds[bounds[:, 1] - bounds[:, 0] > 2]


def sequence_batch(cache: FeatureCache, bounds: np.ndarray, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The cached tensors of the sequences ``bounds`` ``[B, 2]``."""
    out = []
    for a, b in bounds:
        sl = slice(int(a), int(b))
        # np.array copies out of the read-only memory map (torch warns on non-writable arrays)
        out.append({"hidden": torch.from_numpy(np.array(cache.hidden[sl])).float().to(device),
                    "tokens": torch.from_numpy(cache.tokens[sl].astype(np.int64)).to(device),
                    "loss_mask": torch.from_numpy(cache.loss_mask[sl].astype(bool)).to(device),
                    "teacher_ids": torch.from_numpy(np.array(cache.teacher_ids[sl])).long().to(device),
                    "teacher_logp": torch.from_numpy(np.array(cache.teacher_logp[sl])).float().to(device)})
    return out


def fresh_heads(target: nn.Module, cfg: TrainConfig, vocab: torch.Tensor | None = None) -> EagleHeads:
    """New eagle heads for ``target`` (``eagle_init``, ``eagle_layout``); ``vocab`` unused: the
    heads share the target's ``lm_head``."""
    return init_eagle_for(target, cfg.num_heads, base_model_name(target), init=cfg.eagle_init, layout=cfg.eagle_layout)


def cached_batches(cache: FeatureCache, cfg: TrainConfig, device: torch.device) -> Batches:
    """Micro-batches of ``batch_size`` whole cached sequences (:func:`sequence_batch`)."""
    return Batches(sequences(cache), cfg.batch_size, lambda b: {"eagle": sequence_batch(cache, b, device)})


def batch_loss(heads: EagleHeads, target: nn.Module, batch: dict[str, Any], cfg: TrainConfig, weights: list[float],
               vocab: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`eagle_loss` over one micro-batch of cached sequences (eagle trains on the cache only)."""
    return eagle_loss(heads, batch["eagle"], weights, vocab, cfg.feature_weight)


def ttt_visible(n: int, step: int, device: torch.device) -> torch.Tensor:
    """``[n, (step + 1) n]`` which keys the rows of unroll ``step`` see: step 0's keys up to
    ``p - step``, and step ``i``'s key at ``p - step + i`` (``i = 1..step``, itself last)."""
    p = torch.arange(n, device=device)
    visible = torch.zeros(n, (step + 1) * n, dtype=torch.bool, device=device)
    visible[:, :n] = p[None, :] <= (p - step)[:, None]
    for i in range(1, step + 1):
        col = p - step + i
        ok = col >= 0
        visible[p[ok], i * n + col[ok]] = True
    return visible


def eagle_loss(heads: EagleHeads, batch: list[dict[str, torch.Tensor]], weights: list[float],
               vocab: torch.Tensor | None = None, feature_weight: float = 0.1,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed over unroll steps ``j`` (``len(weights)`` of them, weighted): mean KL to the
    target's top-k at the next position (restricted to ``vocab`` when given, renormalised)
    plus ``feature_weight`` times a smooth-L1 feature regression. Counts per step as in
    :func:`medusa.training.losses.heads_loss` (top-1/top-5 against the target's argmax)."""
    from medusa.runtime.hf import new_cache

    steps = len(weights)
    device = heads.fc.weight.device
    counts = {name: torch.zeros(steps, device=device) for name in ("n", "top1", "top5", "loss")}
    index = vocab_index(vocab, heads.config.vocab_size) if vocab is not None else None
    total = torch.zeros((), device=device)
    for seq in batch:
        f, x = seq["hidden"], seq["tokens"]  # [T, H], [T]
        n = f.shape[0] - 2  # pairs p = 0..T-3 have a next position p+1 and a label x_{p+2}
        label_ok = seq["loss_mask"][2:]  # [n]: x_{p+2} is an answer token
        t_ids, t_logp = seq["teacher_ids"][1:n + 1], seq["teacher_logp"][1:n + 1]  # [n, k] at p+1
        t_ids, t_logp, keep, reference = teacher_in_vocab(t_ids, t_logp, index)
        if keep is not None:
            label_ok = label_ok & keep
        cache = new_cache(buffered=False)
        positions = torch.arange(n, device=device)
        feats = f[:n]
        for j in range(steps):
            out = heads(feats, x[1:n + 1], positions, cache, additive_mask(ttt_visible(n, j, device), f.dtype))  # [n, H]
            rows = label_ok & (positions >= j)
            if rows.any():
                logp = torch.log_softmax(heads.logits(out[rows], vocab).float(), dim=-1)  # [r, V or S]
                kl, _ = soft_cross_entropy(logp, t_ids[rows], t_logp[rows])
                reg = F.smooth_l1_loss(out[rows], f[1:n + 1][rows], reduction="none").mean(-1)  # [r]
                per_row = kl + feature_weight * reg
                total = total + weights[j] * per_row.mean() / len(batch)
                add_counts(counts, j, logp, reference[rows], per_row)
            # the next step's pair at p carries this step's prediction for p (row p - 1)
            feats = torch.cat([f[:1], out[:-1]])
    return total, counts
