"""Prompt lookup: a chain copied from where the latest n-gram occurred before (or from an n-gram table)."""

from __future__ import annotations

import torch

from medusa.decoding.state import DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import TreeBuffers, chain_tree
from medusa.errors import MedusaError
from medusa.runtime.ngrams import NgramTable

MATCH_TOKENS = 16  # the longest chain a match gets (where its match length has kept long copies)


def match_length(tokens: list[int], end: int, most: int = MATCH_TOKENS) -> int:
    """How many of the text's last tokens the tokens before ``end`` repeat (at most ``most``)."""
    total, n = len(tokens), 0
    while n < most and n < end and tokens[end - 1 - n] == tokens[total - 1 - n]:
        n += 1
    return n


def match_bucket(n: int) -> int:
    """A match length's bucket: 0 no match in the text (the n-gram table's chain), 1-3 as long,
    4: 4-7 tokens, 5: 8-15, 6: 16 and more."""
    return n if n < 4 else 4 + (n >= 8) + (n >= 16)


class MatchChains:
    """Each step's lookup chain length from how long its match is. A copy that follows a long
    verbatim match (a document being quoted) keeps most of a long chain; one after a single
    matching token keeps little. Per bucket of match lengths (:func:`match_bucket`) it counts,
    over this answer's steps, how often the copy's first token was the target's, and each
    further one given the one before (a uniform prior: one of two); the chain taken is the one
    with the most expected tokens per pass time at the current context length, by the plan's
    pass costs (``costs``, a :class:`~medusa.decoding.payoff.Curves`), from 1 token up to the
    proposer's limit. Greedy output does not depend on it (verification keeps the target's tokens)."""

    def __init__(self, costs) -> None:
        self.costs = costs
        self.counts = [[0, 0, 0, 0] for _ in range(7)]  # per bucket: first kept, first tried, next kept, next tried
        self.pending: tuple[int, list[int]] | None = None  # the step in flight: its bucket and its copy

    def chain(self, bucket: int, length: int, rows: int, most: int) -> int:
        """The chain length for a match in ``bucket`` after ``length`` cached tokens, beside
        ``rows`` other rows (the root and any heads' nodes), at most ``most``."""
        if most < 1:
            return max(most, 0)
        kept, tried, next_kept, next_tried = self.counts[bucket]
        first, further = (kept + 1) / (tried + 2), (next_kept + 1) / (next_tried + 2)
        curve = self.costs.at(length)
        best, best_k, expected, p = 0.0, 1, 1.0, first
        for k in range(1, most + 1):
            expected, p = expected + p, p * further
            rate = expected / curve(rows + k)
            if rate > best:
                best, best_k = rate, k
        return best_k

    def record(self, emitted: list[int]) -> None:
        """The step in flight is verified: ``emitted`` the target's tokens after its root."""
        if self.pending is None:
            return
        bucket, copied = self.pending
        self.pending = None
        kept = 0
        while kept < min(len(copied), len(emitted)) and copied[kept] == emitted[kept]:
            kept += 1
        counts = self.counts[bucket]
        counts[0], counts[1] = counts[0] + (kept >= 1), counts[1] + 1
        for depth in range(2, len(copied) + 1):  # tried at each depth its parent was kept at
            if kept >= depth - 1:
                counts[2], counts[3] = counts[2] + (kept >= depth), counts[3] + 1


class PromptLookup(Proposer):
    """Training-free drafting by n-gram lookup in the prompt and the text generated so far.

    The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up
    at their latest earlier occurrence and the ``num_tokens`` tokens that followed it are
    proposed as a chain (fewer where the text ends first; a span repeating up to the end,
    such as ``a b a b``, is continued with its period). An index of every n-gram's latest end position is extended
    as the sequence grows, so a lookup costs O(``max_ngram``) per step. Where the text has no
    match, ``table`` (an :class:`~medusa.runtime.ngrams.NgramTable` of the target's own
    answers, mode hybrid) drafts the chain instead. With ``costs`` (the plan's pass costs), each
    step's chain is as long as its match's length has paid for (:class:`MatchChains`), up to
    ``num_tokens``; else always ``num_tokens``. The proposal is
    deterministic given the text, so it carries no ``q``: lossless verification treats
    each candidate as a point mass.
    """

    def __init__(self, device: torch.device, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1,
                 table: NgramTable | None = None, costs=None) -> None:
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
        self.costs = costs
        self.chains: MatchChains | None = None  # per answer, where costs are known

    def begin(self, state: DecodeState) -> None:
        self.index = {}
        self.indexed = 0
        self.chains = None if self.costs is None else MatchChains(self.costs)

    def describe(self) -> str:
        text = f"{self.k}-token lookup chain"
        if self.table is not None:  # where the text has no match, the chain comes from the heads' n-gram table
            text += f" (else from {len(self.table):,} n-grams of {self.table.sequences:,} answers)"
        if self.costs is not None:  # the longest; each step's as long as its match's length paid for
            text += ", sized per match"
        return text

    def propose(self, state: DecodeState, limit: int | None = None, rows: int = 1) -> Proposal:
        """The chain; ``limit``: at most that many tokens this step (mode hybrid's chain sized
        for the context length), else ``num_tokens``; ``rows``: the pass's rows beside the chain
        (the root and a heads' tree: what a chain's length is weighed with)."""
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
        bucket = 0
        for n in self.ngrams:
            end = self.index.get(tuple(tokens[total - n:])) if n <= total else None
            if end is not None:
                if self.chains is not None:
                    bucket = match_bucket(match_length(tokens, end))
                    k = self.chains.chain(bucket, state.length, rows, k)
                # Copy what followed. A match that runs into the suffix itself (a repeating
                # span, period total - end) is continued periodically rather than cut short.
                for i in range(state.max_depth(k)):
                    j = end + i
                    follow.append(tokens[j] if j < total else follow[j - total])
                break
        if not follow and self.table is not None:
            if self.chains is not None:
                k = self.chains.chain(bucket, state.length, rows, k)
            follow = self.table.chain(tokens, state.max_depth(k))
        if self.chains is not None:
            self.chains.pending = (bucket, follow) if follow else None
        chain_tokens = torch.tensor(tokens[-1:] + follow, device=self.device)  # [1 + k]: the root, then the copy
        return Proposal(tree=chain_tree(self.trees, len(follow), self.device), tokens=chain_tokens, is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        if self.chains is not None:
            self.chains.record(outcome.tokens)
