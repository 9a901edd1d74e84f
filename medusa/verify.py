"""Acceptance rules, as small pure functions over one verified tree.

Names follow the papers: ``p`` is the target's distribution, ``q`` the proposer's.
Every rule is vectorised over the tree and returns device tensors; the engine makes one
host sync per step when it reads the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.tree import TreeBuffers


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


def verify_greedy(tree: TreeBuffers, tokens: torch.Tensor, logits: torch.Tensor) -> Accepted:
    """Longest root-to-node path whose every token equals the target's argmax.

    ``tokens`` ``[N]`` node tokens (root first), ``logits`` ``[N, V]`` the target's logits
    after each node. The next token is the target's argmax after the last accepted node,
    so each step emits ``length + 1`` tokens, all of them the target's own greedy choice.
    """
    pred = logits.argmax(dim=-1)  # [N] target's next token after each node
    leaves = tree.leaves  # [P, D+1]
    child = leaves[:, 1:]  # [P, D]
    valid = child >= 0
    match = (tokens[child.clamp(min=0)] == pred[leaves[:, :-1].clamp(min=0)]) & valid
    accepted_len = match.long().cumprod(dim=1).sum(dim=1)  # [P]
    best = accepted_len.argmax()
    path = leaves[best]
    length = accepted_len[best]
    return Accepted(path=path, length=length, next_token=pred[path[length]])
