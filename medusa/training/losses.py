"""Head losses: shifted cross-entropy, self-distillation KL, per-head weights.

Head ``k`` (0-based) reads the target's hidden state at position ``t`` and predicts the
token at ``t + k + 2`` (the target's own ``lm_head`` predicts ``t + 1``). Two objectives:

* ground truth: cross-entropy against the data's token at ``t + k + 2``;
* self-distillation: KL from the frozen target's distribution at position ``t + k + 1``
  (the distribution *it* has over token ``t + k + 2``) to the head's. This is what decoding
  verifies heads against, and it needs no generated data.

Both work on positions flattened over the batch: :func:`shift_targets` builds, for every
head, which positions count and what they must predict; :func:`heads_loss` computes the
weighted loss and per-head top-1/top-5 counts. The teacher is given as its top-``k`` ids
and log-probabilities (renormalised over those ``k``): it is what a feature cache stores,
and the tail beyond a few dozen tokens carries almost no probability mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads

IGNORE = -100


@dataclass
class HeadTargets:
    """What each head must predict at each of ``N`` flattened positions."""

    labels: torch.Tensor  # [K, N] long: data token at t+k+2 (IGNORE where invalid)
    valid: torch.Tensor  # [K, N] bool: the position counts for head k
    teacher_ids: torch.Tensor | None = None  # [K, N, k] long: target's top-k at t+k+1
    teacher_logp: torch.Tensor | None = None  # [K, N, k] float: their log-probabilities


def head_weights(num_heads: int, decay: float = 0.8, weights: list[float] | None = None) -> list[float]:
    """Per-head loss weights: explicit ones, else ``decay ** k`` (far heads matter less: a
    speculated token is only useful if every earlier one was accepted)."""
    if weights:
        if len(weights) != num_heads:
            raise MedusaError(f"head_weights has {len(weights)} values for {num_heads} heads: give one per head")
        return [float(w) for w in weights]
    return [decay**k for k in range(num_heads)]


def shift_targets(tokens: torch.Tensor, loss_mask: torch.Tensor, num_heads: int,
                  teacher_ids: torch.Tensor | None = None, teacher_logp: torch.Tensor | None = None) -> HeadTargets:
    """Sequences ``[B, T]`` -> per-head targets over the ``N = B * T`` source positions.

    ``loss_mask[b, j]`` says token ``j`` is one to learn (an assistant token, not padding);
    ``teacher_*`` are ``[B, T, k]``: the target's top-k at every position.
    """
    B, T = tokens.shape
    K = num_heads
    labels = torch.full((K, B, T), IGNORE, dtype=torch.long, device=tokens.device)
    valid = torch.zeros((K, B, T), dtype=torch.bool, device=tokens.device)
    t_ids = t_logp = None
    if teacher_ids is not None:
        k = teacher_ids.shape[-1]
        t_ids = torch.zeros((K, B, T, k), dtype=torch.long, device=tokens.device)
        t_logp = torch.zeros((K, B, T, k), dtype=teacher_logp.dtype, device=tokens.device)
    for h in range(K):
        s = h + 2  # head h at t predicts token t+s
        if T <= s:
            continue
        labels[h, :, : T - s] = tokens[:, s:]
        valid[h, :, : T - s] = loss_mask[:, s:].bool()
        if t_ids is not None:
            t_ids[h, :, : T - s] = teacher_ids[:, s - 1: T - 1]
            t_logp[h, :, : T - s] = teacher_logp[:, s - 1: T - 1]
    labels = labels.masked_fill(~valid, IGNORE)
    flat = lambda x: x.reshape(K, B * T, *x.shape[3:])  # noqa: E731
    return HeadTargets(flat(labels), flat(valid), None if t_ids is None else flat(t_ids),
                       None if t_logp is None else flat(t_logp))


def frequent_tokens(token_ids: torch.Tensor, size: int, vocab_size: int, fill: torch.Tensor | None = None,
                    ) -> torch.Tensor:
    """The ``size`` most frequent ids of ``token_ids``, sorted. Where fewer distinct ids occur,
    the rest are the most frequent of ``fill`` (token ids of other text), then the lowest ids."""
    counts = torch.bincount(token_ids.reshape(-1).long(), minlength=vocab_size)
    if fill is not None:  # every id of the data ranks above every id only the fill has
        extra = torch.bincount(fill.reshape(-1).long(), minlength=vocab_size)
        counts = counts * (int(extra.max()) + 1) + extra
    ranked = torch.sort(counts, descending=True, stable=True).indices  # ties: the lower id first
    return ranked[: min(size, vocab_size)].sort().values


def soft_cross_entropy(logp: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``KL(p || q)`` with ``p`` the teacher renormalised over its top-k.

    ``logp [n, V]`` is the student's log-softmax. Returns ``(kl [n], p [n, k])``.
    """
    p = torch.softmax(teacher_logp.float(), dim=-1)  # [n, k]
    log_p = torch.log_softmax(teacher_logp.float(), dim=-1)
    q = logp.gather(-1, teacher_ids)  # [n, k]
    return (p * (log_p - q)).sum(-1), p


def vocab_index(vocab: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]``: each token id's place in the subset ``vocab`` ``[S]``, -1 outside it."""
    index = torch.full((size,), -1, dtype=torch.long, device=vocab.device)
    index[vocab] = torch.arange(len(vocab), device=vocab.device)
    return index


def teacher_in_vocab(ids: torch.Tensor, logp: torch.Tensor, index: torch.Tensor | None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A teacher's top-k ``[n, k]`` restricted to a vocabulary subset (``index`` None: all).

    Returns ids as positions in the subset, log-probabilities with the ids outside it
    dropped (a row with none left keeps a dummy entry of weight ~0 so the renormalisation
    stays finite), which rows keep any (``[n]`` bool, None without a subset) and the
    reference token ``[n]``: the teacher's argmax (-1, never hit, outside the subset).
    """
    if index is None:
        return ids, logp, None, ids[:, 0]
    reference = index[ids[:, 0]]
    ids = index[ids]
    inside = ids >= 0
    return ids.clamp(min=0), logp.masked_fill(~inside, -1e4), inside.any(-1), reference


@torch.no_grad()
def add_counts(counts: dict[str, torch.Tensor], k: int, logp: torch.Tensor, reference: torch.Tensor,
               per_row: torch.Tensor) -> None:
    """Add head (or unroll step) ``k``'s rows to the summable counts: rows, top-1/top-5 hits
    of ``reference`` under ``logp`` ``[n, V or S]``, summed loss."""
    top5 = logp.topk(min(5, logp.shape[-1]), dim=-1).indices  # [n, 5]
    hit = top5 == reference[:, None]
    counts["n"][k] += len(per_row)
    counts["top1"][k] += hit[:, 0].sum()
    counts["top5"][k] += hit.any(-1).sum()
    counts["loss"][k] += per_row.detach().sum()


def heads_loss(heads: MedusaHeads, hidden: torch.Tensor, targets: HeadTargets, weights: list[float],
               distill: float = 1.0, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum over heads of ``(1 - distill) * CE + distill * KL``.

    ``hidden`` is ``[N, H]`` (the target's final hidden states at the source positions).
    ``vocab`` (``[S]`` token ids) restricts the heads' softmax to a frequent subset: on a
    CPU the vocabulary projection dominates the cost, and drafting only ever proposes
    likely tokens. Targets outside the subset then count as misses; teachers are
    renormalised over their top-k ids inside it.
    Returns the loss and summable counts: ``n [K]`` positions, ``top1 [K]`` and ``top5 [K]``
    hits against the reference token (the target's own argmax when a teacher is given,
    since that is what verification accepts; the data token otherwise), ``loss [K]`` sums.
    """
    K = heads.num_heads
    device = hidden.device
    index = vocab_index(vocab, heads.config.vocab_size) if vocab is not None else None
    counts = {name: torch.zeros(K, device=device) for name in ("n", "top1", "top5", "loss")}
    total = hidden.new_zeros((), dtype=torch.float32)
    if distill > 0 and targets.teacher_ids is None:
        raise MedusaError("self-distillation needs the target's distribution: set distill=0 or give teacher logits")
    for k in range(K):
        rows = targets.valid[k].nonzero().squeeze(-1)  # [n]
        if rows.numel() == 0:
            continue
        logp = torch.log_softmax(heads.logits(hidden[rows], [k], vocab)[0].float(), dim=-1)  # [n, V or S]
        per_row = torch.zeros(rows.numel(), device=device)
        labels = targets.labels[k, rows]
        if index is not None:
            labels = index[labels]  # -1: outside the subset, ignored by the CE
            labels = labels.masked_fill(labels < 0, IGNORE)
        reference = labels
        if distill < 1:
            per_row = per_row + (1 - distill) * F.nll_loss(logp, labels, reduction="none", ignore_index=IGNORE)
        if distill > 0:
            ids, t_logp, keep, reference = teacher_in_vocab(targets.teacher_ids[k, rows],
                                                            targets.teacher_logp[k, rows].float(), index)
            kl, _ = soft_cross_entropy(logp, ids, t_logp)
            per_row = per_row + distill * (kl if keep is None else kl * keep)
        total = total + weights[k] * per_row.mean()
        add_counts(counts, k, logp, reference, per_row)
    return total, counts


def lm_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean ``KL(teacher || student)`` over rows ``[n, V]``: keeps a LoRA-tuned target's
    next-token distribution where the frozen original had it (Medusa-2's guard)."""
    t = torch.log_softmax(teacher_logits.float(), dim=-1)
    s = torch.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()
