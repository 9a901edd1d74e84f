"""Medusa heads' proposer: each head's top-k laid out by a static tree."""

from __future__ import annotations

import torch

from medusa.decoding.proposers import shared
from medusa.decoding.proposers.drawn import draw, drawn_proposal, draws, nearest
from medusa.decoding.proposers.shared import Steps
from medusa.decoding.sampling import probabilities
from medusa.decoding.state import DecodeState, HeadsProposer, Proposal, StepOutcome
from medusa.decoding.tree import TreeBuffers, compile_tree
from medusa.models.heads import MedusaHeads


class MedusaProposer(HeadsProposer):
    """Medusa heads proposing the top-k of each head, arranged by a static tree."""

    @classmethod
    def for_heads(cls, heads: MedusaHeads, device: torch.device, *, size=None,
                  paths: list[tuple[int, ...]] | None = None, dtype: torch.dtype = torch.float32,
                  hybrid: bool = False, draw: int = 1, window: int | None = None) -> MedusaProposer:
        """The static tree ``paths`` over the heads (no size: the tree is the size)."""
        return cls(heads, paths or [], device, draw)

    @staticmethod
    def deepest(heads: MedusaHeads) -> int:
        return heads.num_heads

    def __init__(self, heads: MedusaHeads, paths: list[tuple[int, ...]], device: torch.device, draw: int = 1) -> None:
        """``draw``: a sampled request's candidates per depth, drawn from each head's distribution
        down a chain as deep as the tree (0: the tree's top-k)."""
        tree = compile_tree(paths)
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"tree is {tree.max_depth} deep but there are only {heads.num_heads} heads")
        self.heads = heads
        self.device = device
        self.draw = draw
        self.tree = tree.to(device)
        self.max_rows = self.min_rows = tree.num_nodes
        self.width = max(tree.topk, default=1)
        # the tree cut to each depth the token budget allows, built once per depth:
        # depth -> (tree, candidate index [N-1] into the flattened [D, width] top-k, is_chain)
        self.layouts: dict[int, tuple[TreeBuffers, torch.Tensor, bool]] = {}
        # drawn chains sized per calibrated temperature ((temperature, size), ...): a sampled
        # request draws a chain as deep as the one nearest its temperature (medusa/autotune/drawn.py)
        self.by_temperature: tuple = ()

    def sample_with(self, size, by_temperature: tuple = ()) -> None:
        """Draw sampled requests' chains as deep as calibrated at the nearest temperature
        (``by_temperature``); ``size`` (mode hybrid's EAGLE size) has no meaning for a static tree."""
        self.by_temperature = tuple(by_temperature)
        rows = [self.tree.num_nodes] + [1 + size.nodes for _, size in self.by_temperature]
        self.max_rows, self.min_rows = max(rows), min(rows)

    def _drawn_shape(self, state: DecodeState) -> tuple[int, int]:
        """``(depth, siblings a depth)`` of a sampled request's drawn levels: as calibrated at the
        nearest temperature, else as deep as the greedy tree within its rows (0: plain decoding)."""
        sized = nearest(self.by_temperature, state.sampling)
        if sized is None:
            depth = min(self.tree.max_depth, max(1, self.tree.num_nodes // self.draw)) if self.tree.max_depth else 0
            return state.max_depth(depth), self.draw
        depth = min(sized.depth, self.heads.num_heads) if sized.nodes else 0
        return state.max_depth(depth), max(sized.topk, 1)

    def _layout(self, depth: int) -> tuple[TreeBuffers, torch.Tensor, bool]:
        if depth not in self.layouts:
            tree = self.tree if depth >= self.tree.max_depth else compile_tree(
                [p for p in self.tree.paths if len(p) <= depth]).to(self.device)
            is_chain = all(len(set(p[:-1] for p in tree.paths if len(p) == d)) <= 1 and
                           sum(1 for p in tree.paths if len(p) == d) == 1 for d in range(1, tree.max_depth + 1))
            self.layouts[depth] = (tree, tree.candidate_index().to(self.device), is_chain)
        return self.layouts[depth]

    def begin(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        return shared.alone(self.steps(state))

    def steps(self, state: DecodeState) -> Steps:
        """:meth:`propose` asking for the heads' top-k (medusa/decoding/proposers/shared.py: a batch's
        sequences score in one call where each gets its own bits there)."""
        drawn = draws(state.sampling, self.draw)
        depth, width = self._drawn_shape(state) if drawn else (state.max_depth(self.tree.max_depth), 0)
        if depth == 0:  # a calibrated tree may say heads do not pay here, or one token is left
            return Proposal(tree=self._layout(0)[0], tokens=state.root.view(1), is_chain=True)
        if drawn:
            return self._drawn(state, depth, width)
        tree, candidate_index, is_chain = self._layout(depth)
        top = yield shared.Ask(self, features=state.hidden, topk=(self.width, tree.max_depth))  # [D, width]
        tokens = torch.cat([state.root.view(1), top.reshape(-1)[candidate_index]])
        return Proposal(tree=tree, tokens=tokens, is_chain=is_chain)

    def _drawn(self, state: DecodeState, depth: int, width: int) -> Proposal:
        """Each head's ``width`` candidates drawn from its processed distribution: head ``d`` guesses
        depth ``d + 1`` whatever was drawn above it, so its law is its own at every node."""
        vocab = self.heads.draft_vocab
        logits = self.heads.logits(state.hidden, heads=range(depth), vocab=vocab)  # [D, S or V]
        levels = [draw(logits[d].float(), state.sampling, width, state.generator, self.heads.draft_vocab,
                       self.heads.config.vocab_size) for d in range(depth)]
        return drawn_proposal(state.root, levels)

    @torch.inference_mode()
    def chain_laws(self, state: DecodeState, tokens: list[int]) -> list[torch.Tensor]:
        """The heads' processed laws (``state.sampling`` applied, over the draft vocabulary) at
        depths 1..len(tokens) of a drawn chain, what :meth:`_drawn` draws from: head ``d``'s own
        whatever was drawn above it, so the tokens give only the depth (for the drawn calibration:
        medusa/autotune/drawn.py)."""
        depth = min(len(tokens), self.heads.num_heads)
        if depth == 0:
            return []
        logits = self.heads.logits(state.hidden, heads=range(depth), vocab=self.heads.draft_vocab)  # [D, S or V]
        return [probabilities(logits[d].float(), state.sampling) for d in range(depth)]

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass

    def describe(self) -> str:
        return f"static tree ({self.tree.num_nodes} nodes, depth {self.tree.max_depth})"
