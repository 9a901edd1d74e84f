"""Plain decoding as a proposer: the root alone, one token per target pass (the baseline)."""

from __future__ import annotations

import torch

from medusa.decoding.state import DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import compile_tree


class Autoregressive(Proposer):
    """Plain decoding: the tree is the root alone, one token per target pass."""

    def __init__(self, device: torch.device) -> None:
        self.tree = compile_tree([]).to(device)
        self.max_rows = 1  # the largest proposal, root included (Engine.precompile reads it)
        self.min_rows = 1  # the smallest but for a budget cut (a compiled pass pads up to it)

    def begin(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        return Proposal(tree=self.tree, tokens=state.root.view(1), is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass

    def describe(self) -> str:
        return "one token per pass"
