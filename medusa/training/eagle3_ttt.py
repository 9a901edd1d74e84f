"""Training EAGLE-3 heads: the target's layers read each step, seven draft steps unrolled.

A micro-batch is ``B`` right-padded conversations. The frozen target runs once over them
(:func:`target_outputs`): the residual stream entering the head's ``feature_layers``
(``[B, T, L*H]``) and its top-k next-token distribution at every position. With a feature
cache (``cache_dir``) the target ran once over the data instead and :func:`cached_batch`
reads the same tensors from disk (the features rounded to bfloat16). Then, as in
:mod:`medusa.training.eagle_ttt` (which this batches), step 0 feeds the true pairs
``(fc(features_p), x_{p+1})`` with causal attention; step ``j`` feeds at position ``p`` the
head's own output of step ``j - 1`` at ``p - 1`` and attends to the true pairs up to ``p - j``
and to one pair of each earlier step on its own chain (``ttt_visible``), exactly what
drafting ``j + 1`` tokens deep sees. Every step's loss is the KL from the target's top-k at
``p + 1``, restricted to the head's draft vocabulary, to the head's distribution over it:
a token loss only, no feature regression (EAGLE-3's change). Padded positions are never scored,
and no scored row attends to one (padding sits at the end).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from medusa.config import TrainConfig
from medusa.models.eagle3_heads import Eagle3Heads, init_eagle3_for
from medusa.models.eagle_heads import additive_mask
from medusa.models.heads_config import base_model_name
from medusa.runtime.hf import new_cache
from medusa.training.batches import Batches
from medusa.training.eagle_ttt import sequences, ttt_visible
from medusa.training.feature_cache import FeatureCache, run_layers
from medusa.training.losses import add_counts, soft_cross_entropy, teacher_in_vocab, vocab_index


@torch.no_grad()
def target_outputs(target, ids: torch.Tensor, attn: torch.Tensor, layers: tuple[int, ...], topk: int,
                   ) -> dict[str, torch.Tensor]:
    """The frozen target over ``[B, T]`` ids: ``features`` ``[B, T, L*H]`` (the inputs of
    ``layers``), ``teacher_ids``/``teacher_logp`` ``[B, T, k]`` (its top-k log-probabilities)."""
    features, logits = run_layers(target, layers, ids, attn)
    logits = logits.float()  # [B, T, V]
    top, top_ids = logits.topk(min(topk, logits.shape[-1]), dim=-1)
    return {"features": features, "teacher_ids": top_ids, "teacher_logp": top - logits.logsumexp(-1, keepdim=True)}


def cached_batch(cache: FeatureCache, bounds: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    """The cached sequences ``bounds`` ``[B, 2]`` (start, end), right-padded: what
    :func:`eagle3_loss` reads, as :func:`target_outputs` and ``collate`` would give it."""
    width = int((bounds[:, 1] - bounds[:, 0]).max())
    b, k = len(bounds), cache.teacher_ids.shape[1]
    batch = {"input_ids": torch.zeros((b, width), dtype=torch.long), "attention_mask": torch.zeros((b, width), dtype=torch.long),
             "loss_mask": torch.zeros((b, width), dtype=torch.long),
             "features": torch.zeros((b, width, cache.hidden.shape[1])),
             "teacher_ids": torch.zeros((b, width, k), dtype=torch.long), "teacher_logp": torch.zeros((b, width, k))}
    for i, (lo, hi) in enumerate(bounds):
        sl, n = slice(int(lo), int(hi)), int(hi - lo)
        batch["input_ids"][i, :n] = torch.from_numpy(cache.tokens[sl].astype(np.int64))
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = torch.from_numpy(cache.loss_mask[sl].astype(np.int64))
        batch["features"][i, :n] = cache.hidden_rows(sl)
        batch["teacher_ids"][i, :n] = torch.from_numpy(np.array(cache.teacher_ids[sl]).astype(np.int64))
        batch["teacher_logp"][i, :n] = torch.from_numpy(np.array(cache.teacher_logp[sl])).float()
    return {name: t.to(device) for name, t in batch.items()}


def fresh_heads(target: nn.Module, cfg: TrainConfig, vocab: torch.Tensor | None = None) -> Eagle3Heads:
    """New EAGLE-3 heads for ``target`` over its ``feature_layers``, ``vocab`` their draft vocabulary."""
    return init_eagle3_for(target, cfg.num_heads, vocab, cfg.feature_layers, base_model_name(target))


def cached_batches(cache: FeatureCache, cfg: TrainConfig, device: torch.device) -> Batches:
    """Micro-batches of ``batch_size`` cached sequences, right-padded (:func:`cached_batch`): the
    fused layers' inputs, which block heads over the same layers read too."""
    return Batches(sequences(cache), cfg.batch_size, lambda b: cached_batch(cache, b, device))


def with_features(target: nn.Module, batch: dict[str, Any], layers: tuple[int, ...], cfg: TrainConfig) -> dict[str, Any]:
    """``batch`` with the fused layers' inputs and the target's top-k: from the cache, or from
    the frozen target run over it now (:func:`target_outputs`)."""
    if "features" in batch:
        return batch
    return {**batch, **target_outputs(target, batch["input_ids"], batch["attention_mask"], layers, cfg.teacher_topk)}


def batch_loss(heads: Eagle3Heads, target: nn.Module, batch: dict[str, Any], cfg: TrainConfig, weights: list[float],
               vocab: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`eagle3_loss` over one micro-batch (``vocab`` unused: the heads' own draft vocabulary)."""
    return eagle3_loss(heads, with_features(target, batch, heads.feature_layers, cfg), weights)


def eagle3_loss(heads: Eagle3Heads, batch: dict[str, torch.Tensor], weights: list[float],
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed over unroll steps ``j`` (``len(weights)`` of them, weighted): the mean KL over
    scored rows. ``batch``: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]`` and
    :func:`target_outputs`' tensors. Counts per step as ``heads_loss`` (top-1/top-5 against
    the target's argmax, a miss where it lies outside the draft vocabulary)."""
    steps = len(weights)
    device = heads.fc.weight.device
    counts = {name: torch.zeros(steps, device=device) for name in ("n", "top1", "top5", "loss")}
    ids, valid = batch["input_ids"], batch["attention_mask"].bool()
    features = batch["features"]
    b, t = ids.shape
    n = t - 2  # pairs p = 0..T-3 have a next position p+1 and a label x_{p+2}
    total = torch.zeros((), device=device)
    if n < 1:
        return total, counts
    label_ok = (batch["loss_mask"].bool() & valid)[:, 2:]  # [B, n]: x_{p+2} is an answer token
    vocab = heads.draft_vocab
    index = vocab_index(vocab, heads.config.vocab_size) if vocab is not None else None
    k = batch["teacher_ids"].shape[-1]
    t_ids, t_logp, keep, reference = teacher_in_vocab(batch["teacher_ids"][:, 1:n + 1].reshape(-1, k),
                                                      batch["teacher_logp"][:, 1:n + 1].reshape(-1, k), index)
    label_ok = label_ok.reshape(-1)
    if keep is not None:
        label_ok = label_ok & keep
    positions = torch.arange(n, device=device)
    cache = new_cache(buffered=False)
    tokens = ids[:, 1:n + 1]
    feats = features[:, :n]
    first = heads.fuse(features[:, :1])  # [B, 1, H]: position 0 has no earlier output to carry
    dtype = heads.fc.weight.dtype
    for j in range(steps):
        out = heads.step(feats, tokens, positions[None].expand(b, n), cache,
                         additive_mask(ttt_visible(n, j, device), dtype))  # [B, n, H]
        rows = label_ok & (positions >= j).repeat(b)
        if rows.any():
            logp = torch.log_softmax(heads.logits(out.reshape(b * n, -1)[rows]).float(), dim=-1)  # [r, S]
            kl, _ = soft_cross_entropy(logp, t_ids[rows], t_logp[rows])
            total = total + weights[j] * kl.mean()
            add_counts(counts, j, logp, reference[rows], kl)
        feats = torch.cat([first, out[:, :-1]], dim=1)  # the next step's pair at p carries this step's output at p - 1
    return total, counts
