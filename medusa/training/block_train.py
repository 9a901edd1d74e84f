"""Training block heads (``kind: block``): many blocks per sequence, one drafter pass.

A micro-batch is ``B`` right-padded conversations with the residual stream entering the
fused layers ``[B, T, L*H]`` and the target's top-k next tokens at every position, read from
the feature cache (:func:`medusa.training.eagle3_ttt.cached_batch`, the cache EAGLE-3 heads
of the same layers use) or from the frozen target run on the batch
(:func:`~medusa.training.eagle3_ttt.target_outputs`). In each sequence ``block_anchors``
positions ``t`` are drawn uniformly (:func:`sample_anchors`) among those whose next token
``x_{t+1}`` is an answer token and whose block's last label ``x_{t+k+1}`` lies inside the
sequence; the draw is seeded by the run's seed and the batch's tokens, so a resumed run and
every evaluation draw the same anchors for the same batch. All blocks run in one pass
(:meth:`~medusa.models.block_heads.BlockHeads.train_logits`): block ``a`` sees the context up
to its ``t`` and its own rows, exactly what drafting after ``t`` sees.

Block position ``i`` scores ``x_{t+2+i}``; its loss is ``distill`` times the KL from the
target's top-k at ``t+1+i``, restricted to the draft vocabulary (EAGLE-3's token loss), plus
``1 - distill`` times the cross-entropy of the data's token there (over the draft vocabulary;
a token outside it is not scored). Positions are weighted ``exp(-i / block_decay)`` (an early
miss wastes the rest of the block) and each position's loss is its mean over the anchors
that score it. Counts per block position are ``heads_loss``'s (``head{i+1}`` in the metrics).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from medusa.config import TrainConfig
from medusa.models.block_heads import BlockHeads, init_block_for
from medusa.models.heads_config import base_model_name
from medusa.training.eagle3_ttt import with_features
from medusa.training.losses import IGNORE, add_counts, soft_cross_entropy, teacher_in_vocab, vocab_index


def block_weights(block_size: int, decay: float) -> list[float]:
    """``exp(-i / decay)`` for block positions ``i = 0 .. k-1``."""
    return [math.exp(-i / decay) for i in range(block_size)]


def fresh_heads(target: nn.Module, cfg: TrainConfig, vocab: torch.Tensor | None = None) -> BlockHeads:
    """New block heads of ``num_heads`` tokens for ``target``, ``vocab`` their draft vocabulary."""
    return init_block_for(target, cfg.num_heads, vocab, cfg.feature_layers, base_model_name(target), cfg.num_layers)


def batch_loss(heads: BlockHeads, target: nn.Module, batch: dict[str, Any], cfg: TrainConfig, weights: list[float],
               vocab: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`block_loss` over one micro-batch, the fused layers from the cache or from the frozen
    target now (``vocab`` unused: the heads' own draft vocabulary)."""
    batch = with_features(target, batch, heads.feature_layers, cfg)
    return block_loss(heads, batch, weights, cfg.block_anchors, cfg.distill, cfg.seed)


def sample_anchors(answer: torch.Tensor, lengths: torch.Tensor, block_size: int, count: int, seed: int,
                   tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct anchors per sequence, uniformly among the positions ``t`` with
    ``answer[t+1]`` and ``t + k + 1 < length``. ``answer`` ``[B, T]`` bool (answer tokens),
    ``lengths`` ``[B]``; ``tokens`` ``[B, T]`` and ``seed`` seed the draw. Returns ``anchors``
    ``[B, A]`` and ``ok`` ``[B, A]`` (False: a filler slot, anchor 0, never scored)."""
    b, t_len = answer.shape
    digest = hashlib.blake2b(tokens.detach().cpu().numpy().tobytes(), digest_size=8).digest()
    g = torch.Generator().manual_seed((seed * 1000003 + int.from_bytes(digest, "little")) % 2**63)
    keys = torch.rand((b, t_len), generator=g).to(answer.device)  # [B, T]
    t = torch.arange(t_len, device=answer.device)
    candidate = torch.zeros_like(answer)
    candidate[:, :-1] = answer[:, 1:]
    candidate &= t[None] + block_size + 1 < lengths[:, None]
    keys = keys.masked_fill(~candidate, 2.0)
    picked, anchors = keys.topk(min(count, t_len), dim=1, largest=False)  # the lowest keys: a uniform draw
    ok = picked < 2.0
    return anchors.masked_fill(~ok, 0), ok


def _at(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T, ...]`` at ``pos`` ``[B, A]`` -> ``[B, A, ...]``."""
    index = pos.reshape(*pos.shape, *([1] * (x.dim() - 2))).expand(*pos.shape, *x.shape[2:])
    return x.gather(1, index)


def block_loss(heads: BlockHeads, batch: dict[str, torch.Tensor], weights: list[float], anchors_per_seq: int,
               distill: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum_i weights[i] * mean loss of block position i`` over the sampled anchors, and
    per-position counts. ``batch``: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]``,
    ``features`` ``[B, T, L*H]``, ``teacher_ids``/``teacher_logp`` ``[B, T, k']``."""
    k = heads.block_size
    device = heads.fc.weight.device
    counts = {name: torch.zeros(k, device=device) for name in ("n", "top1", "top5", "loss")}
    ids, valid = batch["input_ids"], batch["attention_mask"].bool()
    answer = batch["loss_mask"].bool() & valid
    t_len = ids.shape[1]
    anchors, ok = sample_anchors(answer, valid.sum(1), k, anchors_per_seq, seed, ids)
    total = torch.zeros((), device=device)
    if not bool(ok.any()):
        return total, counts
    logits = heads.train_logits(heads.fuse(batch["features"]), ids, anchors)  # [B, A, k, S]
    vocab = heads.draft_vocab
    index = vocab_index(vocab, heads.config.vocab_size) if vocab is not None else None
    n_top = batch["teacher_ids"].shape[-1]
    for i in range(k):
        label_pos = (anchors + 2 + i).clamp(max=t_len - 1)  # [B, A]: x_{t+2+i}
        t_ids, t_logp, keep, reference = teacher_in_vocab(_at(batch["teacher_ids"], label_pos - 1).reshape(-1, n_top),
                                                          _at(batch["teacher_logp"], label_pos - 1).reshape(-1, n_top).float(),
                                                          index)
        rows = (ok & _at(answer, label_pos)).reshape(-1)
        if keep is not None and distill >= 1:
            rows &= keep
        if not bool(rows.any()):
            continue
        logp = torch.log_softmax(logits[:, :, i].reshape(-1, logits.shape[-1])[rows].float(), dim=-1)  # [r, S]
        per_row, ref = torch.zeros(logp.shape[0], device=device), reference[rows]
        if distill > 0:
            kl, _ = soft_cross_entropy(logp, t_ids[rows], t_logp[rows])
            per_row = per_row + distill * (kl if keep is None else kl * keep[rows])
        if distill < 1:  # the data's token, as a draft-vocabulary id (IGNORE outside it)
            labels = _at(ids, label_pos).reshape(-1)[rows]
            labels = labels if index is None else index[labels].masked_fill(index[labels] < 0, IGNORE)
            per_row = per_row + (1 - distill) * F.nll_loss(logp, labels, reduction="none", ignore_index=IGNORE)
            ref = ref if distill > 0 else labels.masked_fill(labels == IGNORE, -1)
        total = total + weights[i] * per_row.mean()
        add_counts(counts, i, logp, ref, per_row)
    return total, counts
