"""Proposers: what drafts the candidate tree the target verifies.

Every decoding mode is one proposer behind the same engine loop:

* ``Autoregressive`` - no candidates, the root alone (plain decoding, the baseline);
* ``MedusaProposer`` - the heads' top-k laid out by a static tree.

A proposer answers ``propose(state) -> Proposal`` and hears the outcome through
``update(state, outcome)``; it keeps whatever state it needs (a draft model's cache, an
n-gram index) to itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from medusa.heads import MedusaHeads
from medusa.tree import TreeBuffers, compile_tree

if TYPE_CHECKING:
    from medusa.engine import DecodeState, StepOutcome


@dataclass(frozen=True)
class Proposal:
    """A tree of candidates: ``tokens`` ``[N]`` laid out as ``tree`` (root first).

    ``q`` ``[N, V]``, when given, is the distribution each node's token was drawn from
    (row 0, the root, is unused); rules that sample need it, greedy ones do not.
    ``is_chain`` lets the engine use plain causal attention instead of a tree mask.
    """

    tree: TreeBuffers
    tokens: torch.Tensor
    q: torch.Tensor | None = None
    is_chain: bool = False


class Proposer(Protocol):
    def begin(self, state: "DecodeState") -> None:
        """Called after the prompt is prefilled, before the first ``propose``."""

    def propose(self, state: "DecodeState") -> Proposal: ...

    def update(self, state: "DecodeState", outcome: "StepOutcome") -> None:
        """Called after each verified step with what was accepted."""


class Autoregressive:
    """Plain decoding: the tree is the root alone, one token per target pass."""

    def __init__(self, device: torch.device) -> None:
        self.tree = compile_tree([]).to(device)

    def begin(self, state: "DecodeState") -> None:
        pass

    def propose(self, state: "DecodeState") -> Proposal:
        return Proposal(tree=self.tree, tokens=state.root.view(1), is_chain=True)

    def update(self, state: "DecodeState", outcome: "StepOutcome") -> None:
        pass


class MedusaProposer:
    """Medusa heads proposing the top-k of each head, arranged by a static tree."""

    def __init__(self, heads: MedusaHeads, paths: list[tuple[int, ...]], device: torch.device) -> None:
        tree = compile_tree(paths)
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"tree is {tree.max_depth} deep but there are only {heads.num_heads} heads")
        self.heads = heads
        self.tree = tree.to(device)
        self.width = max(tree.topk)
        self.candidate_index = tree.candidate_index().to(device)  # [N-1] into flattened [D, width]
        self.is_chain = all(len(set(p[:-1] for p in tree.paths if len(p) == d)) <= 1 and
                            sum(1 for p in tree.paths if len(p) == d) == 1 for d in range(1, tree.max_depth + 1))

    def begin(self, state: "DecodeState") -> None:
        pass

    def propose(self, state: "DecodeState") -> Proposal:
        top = self.heads.topk(state.hidden, self.width, num_heads=self.tree.max_depth)  # [D, width]
        tokens = torch.cat([state.root.view(1), top.reshape(-1)[self.candidate_index]])
        return Proposal(tree=self.tree, tokens=tokens, is_chain=self.is_chain)

    def update(self, state: "DecodeState", outcome: "StepOutcome") -> None:
        pass
