"""Acceptance rules, as small pure functions over one verified tree.

Names follow the papers: ``p`` is the target's distribution, ``q`` the proposer's.
Every rule is vectorised over the tree and returns device tensors; the engine makes one
host sync per step when it reads the outcome.

* :func:`verify_greedy` - temperature 0: the longest path of target argmaxes.
* :func:`verify_sampled` - temperature > 0, lossless: speculative sampling over the tree;
  the emitted tokens follow ``p`` exactly, whatever was proposed.
* :func:`verify_typical` - Medusa's typical acceptance: faster, lossy.
* :func:`verify` picks one of them from a :class:`~medusa.sampling.SamplingConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from medusa.decoding.sampling import SamplingConfig, probabilities, sample
from medusa.decoding.tree import TreeBuffers


@dataclass(frozen=True)
class Accepted:
    """The outcome of verifying one tree, still on the device.

    ``path``: ``[D + 1]`` node indices from the root along the chosen path (-1 padded);
    ``length``: scalar, how many non-root nodes of ``path`` were accepted;
    ``next_token``: scalar, the token the target adds after the last accepted node.
    """

    path: torch.Tensor
    length: torch.Tensor
    next_token: torch.Tensor


def verify(tree: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None = None, q: torch.Tensor | None = None) -> Accepted:
    """The rule ``sampling`` asks for: typical if chosen, else greedy at temperature 0 and
    lossless speculative sampling above it."""
    if sampling.acceptance == "typical":
        return verify_typical(tree, tokens, logits, sampling, generator)
    if sampling.greedy:
        return verify_greedy(tree, tokens, logits)
    return verify_sampled(tree, tokens, logits, q, sampling, generator)


def _longest_match(tree: TreeBuffers, tokens: torch.Tensor, pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(path [D + 1], length)``: the longest root-to-node path whose every token equals
    ``pred`` ``[N]`` at its parent."""
    leaves = tree.leaves  # [P, D+1]
    child = leaves[:, 1:]  # [P, D]
    valid = child >= 0
    match = (tokens[child.clamp(min=0)] == pred[leaves[:, :-1].clamp(min=0)]) & valid
    accepted_len = match.long().cumprod(dim=1).sum(dim=1)  # [P]
    best = accepted_len.argmax()
    return leaves[best], accepted_len[best]


def verify_greedy(tree: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor) -> Accepted:
    """Longest root-to-node path whose every token equals the target's argmax.

    ``tokens`` ``[N]`` node tokens (root first), ``logits`` ``[N, V]`` the target's logits
    after each node. The next token is the target's argmax after the last accepted node,
    so each step emits ``length + 1`` tokens, all of them the target's own greedy choice.
    """
    pred = logits.argmax(dim=-1)  # [N] target's next token after each node
    path, length = _longest_match(tree, tokens, pred)
    return Accepted(path=path, length=length, next_token=pred[path[length]])


@lru_cache(maxsize=64)
def _children(paths: tuple[tuple[int, ...], ...], device: str) -> torch.Tensor:
    """``[N, B]`` each node's children in layout (= rank) order, -1 padded; ``B`` = max branching."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    kids: list[list[int]] = [[] for _ in index]
    for p in paths:
        kids[index[p[:-1]]].append(index[p])
    width = max(1, max(len(k) for k in kids))  # a root-only tree still gets one (empty) column
    table = torch.full((len(kids), width), -1, dtype=torch.long)
    for node, k in enumerate(kids):
        table[node, : len(k)] = torch.tensor(k, dtype=torch.long)
    return table.to(device)


def _walk(chosen: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Follow ``chosen`` ``[N]`` (each node's accepted child, -1 for none) from the root:
    ``(path [depth + 1], length)``, without leaving the device."""
    steps = [torch.zeros((), dtype=torch.long, device=chosen.device)]
    for _ in range(depth):
        here = steps[-1]
        steps.append(torch.where(here >= 0, chosen[here.clamp(min=0)], here))
    path = torch.stack(steps)
    return path, (path[1:] >= 0).sum()


def _without(row: torch.Tensor, banned: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``row`` ``[V]`` with the tokens ``banned[valid]`` ``[B]`` set to 0 (duplicates are fine)."""
    hits = torch.zeros_like(row).index_add_(0, banned, valid.to(row.dtype))
    return row.masked_fill(hits > 0, 0.0)


def verify_sampled(tree: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None,
                   sampling: SamplingConfig, generator: torch.Generator | None = None) -> Accepted:
    """Lossless speculative sampling over a tree: the emitted tokens follow ``p`` exactly.

    ``tokens`` ``[N]`` node tokens (root first) laid out as ``tree``; ``logits`` ``[N, V]``
    the target's logits after each node; ``p`` = :func:`~medusa.sampling.probabilities`.
    Starting at the root, each node's children are tried in rank order; child ``c`` with
    token ``t`` is accepted with probability ``min(1, r(t) / q_c(t))``, where ``r`` starts as
    ``p`` and after each rejected child becomes ``norm(max(r - q_c, 0))`` (SpecInfer's
    multi-candidate rule). The walk continues at an accepted child; at a node whose
    children are all rejected (or a leaf) the next token is drawn from the final ``r``.
    Every emitted token is then distributed exactly as ``p`` after its prefix.

    ``q`` ``[N, V]``: row ``c`` is the law node ``c``'s token was drawn from, given the
    siblings drawn before it (for siblings sampled without replacement that is the
    parent's draft distribution with the earlier siblings removed and renormalised; for a
    chain, the draft's distribution at that depth: classic Leviathan/Chen rejection
    sampling). Row 0 is unused.

    ``q=None`` means the candidates are deterministic (Medusa's top-k of each head): each
    child's ``q`` is a point mass on its own token. The rule above then simplifies to:
    draw ``x ~ p`` at the current node; if ``x`` is one of its children move there,
    otherwise emit ``x``. A point mass is the only ``q`` consistent with candidates that
    are not random, and it is also the best possible: a node moves on with probability
    ``sum of p over its children``, the most any lossless rule can accept. Each node then
    needs one uniform plus, at the final node only, one draw from ``p`` with its children
    removed, so this path never samples the whole ``[N, V]`` table.

    Randomness is drawn for every node at once (independent per node), so the rule is
    vectorised over the tree; only the nodes on the walked path influence the outcome.
    """
    p = probabilities(logits, sampling)  # [N, V]
    kids = _children(tree.paths, str(tokens.device))  # [N, B]
    kid_tokens = tokens[kids.clamp(min=0)]  # [N, B]
    if q is None:
        return _accept_point_mass(tree, p, kids, kid_tokens, generator)
    return _accept_drawn(tree, p, q, kids, kid_tokens, generator)


def _accept_point_mass(tree: TreeBuffers, p: torch.Tensor, kids: torch.Tensor, kid_tokens: torch.Tensor,
                       generator: torch.Generator | None) -> Accepted:
    """:func:`verify_sampled` for deterministic candidates (``q`` a point mass per child)."""
    n, width = kids.shape
    valid = kids >= 0  # [N, B]
    # x ~ p lands on child j with probability p(t_j): split one uniform over the children.
    # A sibling repeating an earlier sibling's token gets no share (x can only move once).
    earlier = torch.ones(width, width, dtype=torch.bool, device=p.device).tril(-1)  # [j, i]: i < j
    repeat = ((kid_tokens[:, :, None] == kid_tokens[:, None, :]) & valid[:, None, :] & earlier).any(-1)
    p_kids = p.gather(1, kid_tokens).double() * (valid & ~repeat)  # [N, B]
    u = torch.rand((n, 1), generator=generator, device=p.device, dtype=torch.float64)
    hit = (u < p_kids.cumsum(dim=1)) & valid  # [N, B]; the first True is the child x hit
    first = hit.long().argmax(dim=1, keepdim=True)
    chosen = torch.where(hit.any(dim=1), kids.gather(1, first).squeeze(1), -1)  # [N]
    path, length = _walk(chosen, tree.max_depth)
    stop = path[length]
    # x missed every child: it follows p with the children's tokens removed.
    rest = _without(p[stop], kid_tokens[stop], valid[stop])
    # Rounding can leave no mass (children held all of p): then x ~ p is still exact.
    rest = torch.where(rest.sum() > 0, rest, p[stop])
    return Accepted(path=path, length=length, next_token=sample(rest, generator))


def _accept_drawn(tree: TreeBuffers, p: torch.Tensor, q: torch.Tensor, kids: torch.Tensor,
                  kid_tokens: torch.Tensor, generator: torch.Generator | None) -> Accepted:
    """:func:`verify_sampled` for drawn candidates: SpecInfer's multi-candidate rule with ``q``."""
    n, width = kids.shape
    residual = p
    chosen = torch.full((n,), -1, dtype=torch.long, device=p.device)
    for j in range(width):
        c = kids[:, j]  # [N] j-th child of every node (or -1)
        live = (c >= 0) & (chosen < 0)
        t = kid_tokens[:, j : j + 1]  # [N, 1]
        q_c = q[c.clamp(min=0)].float()  # [N, V] law of each j-th child's token
        p_t = residual.gather(1, t).squeeze(1)
        q_t = q_c.gather(1, t).squeeze(1)
        u = torch.rand(n, generator=generator, device=p.device)
        ok = live & (u * q_t < p_t)  # accept with probability min(1, p_t / q_t)
        chosen = torch.where(ok, c, chosen)
        left = (residual - q_c).clamp(min=0)
        mass = left.sum(dim=1, keepdim=True)
        rejected = (live & ~ok)[:, None] & (mass > 0)
        residual = torch.where(rejected, left / mass.clamp(min=torch.finfo(left.dtype).tiny), residual)
    path, length = _walk(chosen, tree.max_depth)
    return Accepted(path=path, length=length, next_token=sample(residual[path[length]], generator))


def verify_typical(tree: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor, sampling: SamplingConfig,
                   generator: torch.Generator | None = None) -> Accepted:
    """Medusa's typical acceptance (lossy): accept a candidate ``t`` after node ``u`` when
    ``p_u(t) > min(epsilon, delta * exp(-H(p_u)))``.

    The longest accepted path wins, ties broken by its likelihood under ``p``; the next
    token is drawn from ``p`` after the last accepted node. The output does not follow
    ``p`` (likely candidates are accepted outright), which is why this is opt-in. At
    temperature 0, ``p`` is one-hot, ``H = 0`` and only the argmax passes: greedy decoding.
    """
    p = probabilities(logits, sampling)  # [N, V]
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # [N]
    threshold = torch.clamp(sampling.typical_delta * torch.exp(-entropy), max=sampling.typical_epsilon)  # [N]
    leaves = tree.leaves  # [P, D+1]
    child, parent = leaves[:, 1:], leaves[:, :-1].clamp(min=0)  # [P, D]
    p_child = p[parent, tokens[child.clamp(min=0)]]  # [P, D]
    ok = (p_child > threshold[parent]) & (child >= 0)
    kept = ok.long().cumprod(dim=1).bool()  # [P, D] accepted prefix of each path
    accepted_len = kept.sum(dim=1)  # [P]
    loglik = torch.where(kept, p_child.clamp(min=torch.finfo(p.dtype).tiny).log(), 0.0).sum(dim=1)  # [P]
    best = torch.where(accepted_len == accepted_len.max(), loglik, float("-inf")).argmax()
    path, length = leaves[best], accepted_len[best]
    return Accepted(path=path, length=length, next_token=sample(p[path[length]], generator))
