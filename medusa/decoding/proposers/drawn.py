"""Drawn proposals: for a sampled request, heads draw their candidates from their own processed
distribution and hand verification the law each one was drawn from (``q``).

A deterministic top-k candidate is a point mass to lossless verification: it is kept with
probability ``p(token)``, which shrinks as the temperature spreads ``p``. A candidate drawn from
``q`` - the head's logits with the request's temperature, top-k and top-p applied, as the target's
are (:func:`~medusa.decoding.sampling.probabilities`) - is kept with probability
``sum_t min(p(t), q(t))``, which stays high wherever the head's distribution is close to the
target's (Leviathan/Chen; for siblings drawn without replacement SpecInfer's multi-candidate rule,
:func:`medusa.decoding.verify.verify_sampled`). Either way the emitted tokens follow ``p`` exactly.

A drawn proposal is a chain with ``width`` candidates per depth (``width`` 1: a chain): at each
depth ``width`` tokens are drawn without replacement, sibling ``j``'s law being ``q`` with the
earlier siblings removed and renormalised; the chain goes on below the first one. Every drawn
candidate stays in the tree, in the order drawn: dropping one after seeing it (the top-k trees'
selection by score) would bias what verification keeps. Draws come from the request's generator,
so a seed gives the same sample alone and batched.
"""

from __future__ import annotations

import functools

import torch

from medusa.decoding.sampling import SamplingConfig, probabilities, sample
from medusa.decoding.state import Proposal
from medusa.decoding.tree import TreeBuffers, compile_tree

Path_ = tuple[int, ...]


def draws(sampling: SamplingConfig, width: int) -> bool:
    """Whether a request's candidates are drawn: sampled, lossless acceptance (typical acceptance
    ignores ``q``), and drawing not turned off (``width`` 0)."""
    return width > 0 and not sampling.greedy and sampling.acceptance == "lossless"


def nearest(by_temperature: tuple, sampling: SamplingConfig):
    """The size calibrated at the temperature nearest the request's, from ``by_temperature``
    (``((temperature, size), ...)``, medusa/autotune/drawn.py); None where none was calibrated."""
    if not by_temperature:
        return None
    return min(by_temperature, key=lambda item: abs(item[0] - sampling.temperature))[1]


def siblings_paths(widths: tuple[int, ...]) -> list[Path_]:
    """The nodes of a chain with ``widths[d]`` candidates at depth ``d + 1``, depth-major: node
    ``(0,) * d + (j,)`` is the ``j``-th candidate at depth ``d + 1``, below the chain's first ones."""
    return [(0,) * d + (j,) for d, width in enumerate(widths) for j in range(width)]


@functools.lru_cache(maxsize=256)
def _tree(widths: tuple[int, ...]) -> TreeBuffers:
    return compile_tree(siblings_paths(widths))


def draw(logits: torch.Tensor, sampling: SamplingConfig, width: int, generator: torch.Generator | None,
         ids: torch.Tensor | None, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``width`` candidates drawn without replacement from the head's ``logits`` ``[S]`` processed
    as the request's sampling asks: their target token ids ``[width]`` and each one's law over the
    target's vocabulary ``[width, vocab_size]`` (``q``, the earlier ones removed and renormalised).
    ``ids`` ``[S]``: the target id of each of the logits' entries (a draft vocabulary; None: the
    entries are the target's ids). Fewer than ``width`` where top-k or top-p leave fewer tokens."""
    left = probabilities(logits, sampling)  # [S]
    if width > 1:  # (a host read; a chain needs none)
        width = min(width, int((left > 0).sum()))
    picked, laws = [], []
    for _ in range(width):
        total = left.sum()
        laws.append(left / total)
        token = sample(left, generator)
        picked.append(token)
        left = left.index_fill(0, token.view(1), 0.0)
    law = torch.stack(laws)  # [width, S]
    chosen = torch.stack(picked)  # [width] entries of the logits
    if ids is None:
        return chosen, law
    full = law.new_zeros(width, vocab_size)
    full[:, ids] = law
    return ids[chosen], full


def drawn_proposal(root: torch.Tensor, levels: list[tuple[torch.Tensor, torch.Tensor]]) -> Proposal:
    """The proposal of ``levels`` (per depth, :func:`draw`'s ``(tokens [w], q [w, V])``) below
    the root token ``root``; ``q``'s row 0, the root's, is unused (zeros)."""
    device = root.device
    tokens = torch.cat([root.view(1)] + [t.to(root.dtype) for t, _ in levels])
    rows = [q for _, q in levels]
    q = torch.cat([rows[0].new_zeros(1, rows[0].shape[-1]), *rows])  # [N, V]
    widths = tuple(t.numel() for t, _ in levels)
    return Proposal(tree=_tree(widths).to(device), tokens=tokens, q=q, is_chain=max(widths, default=1) == 1)
