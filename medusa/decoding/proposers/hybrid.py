"""Mode hybrid: a heads proposer and prompt lookup (and, if asked, lookahead's window and pool)
verified together in one target pass."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from medusa.decoding.proposers import shared
from medusa.decoding.proposers.autoregressive import Autoregressive
from medusa.decoding.proposers.lookahead import LookaheadProposer, cached_tree
from medusa.decoding.proposers.shared import Steps
from medusa.decoding.state import DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import TreeBuffers, compile_tree, graft, spelled


@functools.lru_cache(maxsize=512)
def _hybrid_layout(base: tuple[tuple[int, ...], ...], k: int, attach: tuple[int, ...] = (),
                   ) -> tuple[TreeBuffers, torch.Tensor, torch.Tensor, bool]:
    """The tree of ``base`` plus a ``k``-token chain hanging off its node ``attach`` (the root
    by default), where the base's nodes (root first) and the chain's nodes go in it, and
    whether the whole is one chain. The chain takes rank ``branch`` = one past the largest
    rank of ``attach``'s children in the base, so it never collides."""
    branch = max((p[-1] for p in base if len(p) == len(attach) + 1 and p[:-1] == attach), default=-1) + 1
    chain_paths = [attach + (branch,) + (0,) * d for d in range(k)]
    tree = compile_tree(list(base) + chain_paths)
    index = {path: i + 1 for i, path in enumerate(tree.paths)}
    base_nodes = torch.tensor([0] + [index[path] for path in base], dtype=torch.long)
    chain_nodes = torch.tensor([index[path] for path in chain_paths], dtype=torch.long)
    return tree, base_nodes, chain_nodes, len(tree.paths) == max(map(len, tree.paths), default=0)


class Hybrid(Proposer):
    """A heads proposer (Medusa's static tree or EAGLE's dynamic one) and prompt lookup
    (``lookup``: a :class:`~medusa.decoding.proposers.lookup.PromptLookup`), verified together in one
    target pass; with ``lookahead``, lookahead's pool n-grams and window too (greedy only).

    The heads' tree and, when the n-gram index finds a match, the lookup chain go into one
    tree; verification keeps the longest accepted path of either. Where the chain starts with
    tokens the heads drafted too (often: both guess the likeliest continuation), it shares
    their nodes and only its rest hangs off the deepest shared node, so the pass verifies the
    same candidates with fewer rows. The two are
    complementary: the heads guess short continuations anywhere, the lookup copies long
    spans where the answer repeats the prompt or itself. Where the target's pass costs about
    the same for a few more nodes (GPUs), the chain is nearly free. A combined layout is
    compiled once per (heads' tree, chain length, shared node). For a sampled request whose heads
    drew their candidates (medusa/decoding/proposers/drawn.py), their rows keep the laws they were
    drawn from and the chain's rows are point masses, verified together by one rule.
    """

    def __init__(self, heads: Proposer, lookup: Proposer, device: torch.device,
                 lookahead: LookaheadProposer | None = None, chain_at: Callable[[int], int] | None = None) -> None:
        """``chain_at(length)``: the lookup chain's length for a step after ``length`` cached
        tokens (sized per context length with the heads' tree; None: always ``lookup.k``)."""
        self.heads, self.lookup, self.device, self.lookahead = heads, lookup, device, lookahead
        self.chain_at = chain_at
        rows = heads.max_rows  # None: a heads proposer that does not say
        self.max_rows = None if rows is None else rows + lookup.k + (0 if lookahead is None else lookahead.max_rows - 1)
        self.min_rows = heads.min_rows
        self.jacobi = False  # this generation runs the lookahead part (greedy ones only)
        # the last step's lean option beside its heads' tree (medusa/decoding/payoff.py): the tokens
        # its lookup chain alone would have emitted and that chain's rows, root included (None: the
        # step had no heads' tree beside a chain to weigh)
        self.alone: tuple[int, int] | None = None
        self._chain: list[int] | None = None  # this step's chain beside the heads' tree
        self.root = Autoregressive(device)  # a lean step where no chain is sized

    def describe(self) -> str:
        text = f"{self.heads.describe()} + {self.lookup.describe()}"
        return text if self.lookahead is None else f"{text} + {self.lookahead.describe()} (greedy answers)"

    def begin(self, state: DecodeState) -> None:
        self.heads.begin(state)
        self.lookup.begin(state)
        self.jacobi = self.lookahead is not None and state.sampling.greedy
        if self.jacobi:
            self.lookahead.begin(state)

    def propose(self, state: DecodeState) -> Proposal:
        return shared.alone(self.steps(state))

    def steps(self, state: DecodeState) -> Steps:
        """:meth:`propose` asking for the heads' calls as the heads proposer's own :meth:`steps` do."""
        limit = None if self.chain_at is None else self.chain_at(state.length)
        if limit and getattr(self.lookup, "costs", None) is not None:
            limit = None  # the chain's length is the lookup's, by its match (0 stays: no chain here)
        sized = getattr(self.heads, "chain_for", None)  # a drawn request's chain, sized with its temperature
        here = None if sized is None else sized(state)
        if here is not None:
            limit = here if limit is None else min(limit, here)
        self._chain = None
        guessed = yield from self.heads.steps(state)  # (EAGLE heads skip their levels on a lean step)
        if state.lean and not self.jacobi:  # the lean option: the lookup chain without the heads' tree
            return self.root.propose(state) if limit == 0 else self.lookup.propose(state, limit)
        if limit == 0 and not self.jacobi:  # sized without a chain at this context length
            self._chain = [] if guessed.tree.paths else None
            return guessed
        copied = self.lookup.propose(state, limit, rows=max(1, guessed.tokens.numel()))
        k = copied.tokens.numel() - 1
        if self.jacobi:
            return self._with_lookahead(state, guessed, copied.tokens[1:].tolist())
        if not guessed.tree.paths:  # a calibrated tree may be empty: then this is plain lookup
            return copied
        self._chain = copied.tokens[1:].tolist()
        if k == 0:
            return guessed
        # the chain's start that the heads drafted too shares their nodes: only the rest gets rows
        shared = spelled(guessed.tree.paths, guessed.tokens[1:].tolist(), copied.tokens[1:].tolist())
        attach = shared[-1] if shared else ()
        if len(attach) == k:  # the heads drafted the whole chain
            return guessed
        tree, base_nodes, chain_nodes, is_chain = _hybrid_layout(guessed.tree.paths, k - len(attach), attach)
        tree = tree.to(self.device)
        tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=self.device)
        tokens[base_nodes.to(self.device)] = guessed.tokens.long()
        tokens[chain_nodes.to(self.device)] = copied.tokens[1 + len(attach):].long()
        q = None
        if guessed.q is not None:  # drawn heads' rows keep their laws; the chain's are point masses
            q = guessed.q.new_zeros(tree.num_nodes, guessed.q.shape[-1])
            q[base_nodes.to(self.device)] = guessed.q
            q[chain_nodes.to(self.device), tokens[chain_nodes.to(self.device)]] = 1.0
        return Proposal(tree=tree, tokens=tokens, q=q, is_chain=is_chain)

    def _with_lookahead(self, state: DecodeState, guessed: Proposal, chain: list[int]) -> Proposal:
        """The heads' tree grown by the lookup chain and the lookahead pool's n-grams (shared
        prefixes shared), with the Jacobi window as side rows of the same pass."""
        grams = ([chain] if chain else []) + self.lookahead.guesses(state)
        paths, token_of = graft(guessed.tree.paths, guessed.tokens[1:].tolist(), grams)
        tree = cached_tree(paths, str(self.device))
        tokens = torch.tensor([state.tokens[-1]] + [token_of[p] for p in tree.paths], device=self.device)
        side = self.lookahead.window(tree.num_nodes) if state.max_depth(1) else None
        return Proposal(tree=tree, tokens=tokens, side=side, is_chain=side is None and len(tree.leaves) == 1)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        self.alone = None
        if self._chain is not None:  # what the chain alone would have emitted: its run of the target's tokens
            kept = next((i for i, (a, b) in enumerate(zip(self._chain, outcome.tokens)) if a != b),
                        min(len(self._chain), len(outcome.tokens)))
            self.alone = (kept + 1, 1 + len(self._chain))
        self.heads.update(state, outcome)
        self.lookup.update(state, outcome)
        if self.jacobi:
            self.lookahead.update(state, outcome)
