"""Prompt lookup: a chain copied from where the latest n-gram occurred before (or from an n-gram table)."""

from __future__ import annotations

import torch

from medusa.decoding.state import DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import TreeBuffers, chain_tree
from medusa.errors import MedusaError
from medusa.runtime.ngrams import NgramTable


class PromptLookup(Proposer):
    """Training-free drafting by n-gram lookup in the prompt and the text generated so far.

    The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up
    at their latest earlier occurrence and the ``num_tokens`` tokens that followed it are
    proposed as a chain (fewer where the text ends first; a span repeating up to the end,
    such as ``a b a b``, is continued with its period). An index of every n-gram's latest end position is extended
    as the sequence grows, so a lookup costs O(``max_ngram``) per step. Where the text has no
    match, ``table`` (an :class:`~medusa.runtime.ngrams.NgramTable` of the target's own
    answers, mode hybrid) drafts the chain instead. The proposal is
    deterministic given the text, so it carries no ``q``: lossless verification treats
    each candidate as a point mass.
    """

    def __init__(self, device: torch.device, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1,
                 table: NgramTable | None = None) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise MedusaError(f"lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram, "
                              f"got {num_tokens}, {min_ngram}, {max_ngram}")
        self.device = device
        self.k = num_tokens
        self.ngrams = range(max_ngram, min_ngram - 1, -1)
        self.table = table
        self.trees: dict[int, TreeBuffers] = {}
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.indexed = 0  # n-grams ending at or before this position are indexed
        self.max_rows = 1 + num_tokens
        self.min_rows = 1  # no match: the root alone

    def begin(self, state: DecodeState) -> None:
        self.index = {}
        self.indexed = 0

    def describe(self) -> str:
        text = f"{self.k}-token lookup chain"
        if self.table is not None:  # where the text has no match, the chain comes from the heads' n-gram table
            text += f" (else from {len(self.table):,} n-grams of {self.table.sequences:,} answers)"
        return text

    def propose(self, state: DecodeState, limit: int | None = None) -> Proposal:
        """The chain; ``limit``: at most that many tokens this step (mode hybrid's chain sized
        for the context length), else ``num_tokens``."""
        k = self.k if limit is None else min(limit, self.k)
        tokens = state.tokens
        total = len(tokens)
        # Index n-grams that end before the last token, so each has a continuation.
        for end in range(self.indexed + 1, total):
            for n in self.ngrams:
                if n <= end:
                    self.index[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, total - 1)
        follow: list[int] = []
        for n in self.ngrams:
            end = self.index.get(tuple(tokens[total - n:])) if n <= total else None
            if end is not None:
                # Copy what followed. A match that runs into the suffix itself (a repeating
                # span, period total - end) is continued periodically rather than cut short.
                for i in range(state.max_depth(k)):
                    j = end + i
                    follow.append(tokens[j] if j < total else follow[j - total])
                break
        if not follow and self.table is not None:
            follow = self.table.chain(tokens, state.max_depth(k))
        chain_tokens = torch.tensor(tokens[-1:] + follow, device=self.device)  # [1 + k]: the root, then the copy
        return Proposal(tree=chain_tree(self.trees, len(follow), self.device), tokens=chain_tokens, is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass
