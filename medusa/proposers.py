"""Proposers: what drafts the candidate tree the target verifies.

Every decoding mode is one proposer behind the same engine loop:

* ``Autoregressive`` - no candidates, the root alone (plain decoding, the baseline);
* ``MedusaProposer`` - the heads' top-k laid out by a static tree;
* ``DraftModel`` - a small causal LM drafting a chain token by token;
* ``PromptLookup`` - a chain copied from where the latest n-gram occurred before;
* ``Hybrid`` - the heads' tree and the lookup chain side by side in one tree.

A proposer answers ``propose(state) -> Proposal`` and hears the outcome through
``update(state, outcome)``; it keeps whatever state it needs (a draft model's cache, an
n-gram index) to itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import PreTrainedModel

from medusa import cache as kv
from medusa.errors import MedusaError
from medusa.heads import MedusaHeads
from medusa.sampling import probabilities, sample
from medusa.target import context_window
from medusa.tree import TreeBuffers, chain, compile_tree

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
    def begin(self, state: DecodeState) -> None:
        """Called after the prompt is prefilled, before the first ``propose``."""

    def propose(self, state: DecodeState) -> Proposal: ...

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        """Called after each verified step with what was accepted."""


class Autoregressive:
    """Plain decoding: the tree is the root alone, one token per target pass."""

    def __init__(self, device: torch.device) -> None:
        self.tree = compile_tree([]).to(device)

    def begin(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        return Proposal(tree=self.tree, tokens=state.root.view(1), is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass


class MedusaProposer:
    """Medusa heads proposing the top-k of each head, arranged by a static tree."""

    def __init__(self, heads: MedusaHeads, paths: list[tuple[int, ...]], device: torch.device) -> None:
        tree = compile_tree(paths)
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"tree is {tree.max_depth} deep but there are only {heads.num_heads} heads")
        self.heads = heads
        self.tree = tree.to(device)
        self.width = max(tree.topk, default=1)
        self.candidate_index = tree.candidate_index().to(device)  # [N-1] into flattened [D, width]
        self.is_chain = all(len(set(p[:-1] for p in tree.paths if len(p) == d)) <= 1 and
                            sum(1 for p in tree.paths if len(p) == d) == 1 for d in range(1, tree.max_depth + 1))

    def begin(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        if self.tree.max_depth == 0:  # a calibrated tree may say heads do not pay here
            return Proposal(tree=self.tree, tokens=state.root.view(1), is_chain=True)
        top = self.heads.topk(state.hidden, self.width, num_heads=self.tree.max_depth)  # [D, width]
        tokens = torch.cat([state.root.view(1), top.reshape(-1)[self.candidate_index]])
        return Proposal(tree=self.tree, tokens=tokens, is_chain=self.is_chain)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass


def _chain_tree(trees: dict[int, TreeBuffers], k: int, device: torch.device) -> TreeBuffers:
    """The compiled chain of ``k`` candidates, built once per length."""
    if k not in trees:
        trees[k] = compile_tree(chain(k)).to(device)
    return trees[k]


class DraftModel:
    """Classic speculative decoding: a small causal LM drafts ``k`` tokens one by one.

    The draft keeps its own KV cache of ``cached`` tokens, always a prefix of the
    sequence. Each step it runs whatever the target emitted since (the root, plus the
    last draft token when the whole chain was accepted), then drafts ``k`` tokens; the
    ``k``-th is never fed, so after the target accepts ``m`` of them the draft cache is
    cropped to the sequence's common prefix and stays exact. When the state samples
    (``state.sampling`` not greedy) each token is drawn from ``q``, the draft's
    distribution processed like the target's (temperature, top-k, top-p), with the
    state's generator, and the ``q`` rows go to the verifier for lossless rejection
    sampling; at temperature 0 the draft is greedy. ``adaptive`` grows ``k`` by 2
    after a fully accepted chain and shrinks it by 1 after a rejection, within
    ``[1, max_tokens]``. ``confidence`` > 0 ends a chain early after a token the draft
    itself gave less than that probability (a likely rejection: drafting past it is
    mostly wasted work); it costs one host sync per draft token.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        num_tokens: int = 4,
        adaptive: bool = False,
        max_tokens: int = 16,
        confidence: float = 0.0,
    ) -> None:
        if num_tokens < 1 or max_tokens < num_tokens:
            raise MedusaError(f"draft tokens need 1 <= num_tokens <= max_tokens, got {num_tokens} and {max_tokens}")
        self.model = model
        self.device = device
        self.k = num_tokens
        self.adaptive = adaptive
        self.max_tokens = max_tokens
        self.confidence = confidence
        self.window = context_window(model)
        self.trees: dict[int, TreeBuffers] = {}
        self.cache = kv.new_cache()
        self.cached: list[int] = []  # the tokens whose KV entries are in ``cache``
        self.pending: torch.Tensor | None = None  # [k - 1] draft tokens fed in the last propose
        self.drafted = 0  # chain length of the last proposal

    def begin(self, state: DecodeState) -> None:
        self.cache = kv.new_cache()
        self.cached = []
        self.pending = None

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Proposal:
        n, total = len(self.cached), len(state.tokens)
        # The draft writes positions n .. total + k - 2; stay inside its context window.
        k = self.k if self.window is None else min(self.k, self.window - total + 1)
        if k < 1:
            self.drafted = 0
            self.pending = None
            return Proposal(tree=_chain_tree(self.trees, 0, self.device), tokens=state.root.view(1), is_chain=True)
        ids = torch.tensor([state.tokens[n:]], device=self.device)  # [1, total - n]
        pos = torch.arange(n, total, device=self.device)[None]
        drafted: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            logits, _ = kv.forward(self.model, ids, pos, self.cache, None, logits_rows=slice(-1, None))  # [1, V]
            if state.sampling.greedy:
                token = logits[0].argmax()
                q = torch.softmax(logits[0], dim=-1) if self.confidence > 0 else None  # [V]
            else:
                q = probabilities(logits[0], state.sampling)  # [V] the draft's processed distribution
                token = sample(q, state.generator)
                rows.append(q)
            drafted.append(token)
            if i + 1 == k or (self.confidence > 0 and float(q[token]) < self.confidence):
                break
            ids, pos = token.view(1, 1), pos[:, -1:] + 1
        chain_tokens = torch.stack(drafted)  # [k'], k' <= k
        k = self.drafted = len(drafted)
        self.pending = chain_tokens[:-1]
        self.cached.extend(state.tokens[n:])
        q_rows = None
        if rows:
            q_rows = torch.cat([torch.zeros_like(rows[0])[None], torch.stack(rows)])  # [k + 1, V], row 0 unused
        tokens = torch.cat([state.root.view(1), chain_tokens])  # [k + 1]
        return Proposal(tree=_chain_tree(self.trees, k, self.device), tokens=tokens, q=q_rows, is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        # What the draft cache holds beyond the old prefix: the fed draft tokens. Keep the
        # part the target agreed with, drop the rest.
        n = len(self.cached)
        if self.pending is not None:
            self.cached.extend(self.pending.tolist())
            self.pending = None
        keep = n
        while keep < len(self.cached) and keep < len(state.tokens) and self.cached[keep] == state.tokens[keep]:
            keep += 1
        del self.cached[keep:]
        kv.crop(self.cache, keep)
        if self.adaptive and self.drafted:
            accepted = len(outcome.tokens) - 1
            self.k = min(self.k + 2, self.max_tokens) if accepted >= self.drafted else max(self.k - 1, 1)


class PromptLookup:
    """Training-free drafting by n-gram lookup in the prompt and the text generated so far.

    The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up
    at their latest earlier occurrence and the ``num_tokens`` tokens that followed it are
    proposed as a chain (fewer where the text ends first; a span repeating up to the end,
    such as ``a b a b``, is continued with its period). An index of every n-gram's latest end position is extended
    as the sequence grows, so a lookup costs O(``max_ngram``) per step. The proposal is
    deterministic given the text, so it carries no ``q``: lossless verification treats
    each candidate as a point mass.
    """

    def __init__(self, device: torch.device, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise MedusaError(f"lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram, "
                              f"got {num_tokens}, {min_ngram}, {max_ngram}")
        self.device = device
        self.k = num_tokens
        self.ngrams = range(max_ngram, min_ngram - 1, -1)
        self.trees: dict[int, TreeBuffers] = {}
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.indexed = 0  # n-grams ending at or before this position are indexed

    def begin(self, state: DecodeState) -> None:
        self.index = {}
        self.indexed = 0

    def propose(self, state: DecodeState) -> Proposal:
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
                for i in range(self.k):
                    j = end + i
                    follow.append(tokens[j] if j < total else follow[j - total])
                break
        chain_tokens = torch.tensor(tokens[-1:] + follow, device=self.device)  # [1 + k]: the root, then the copy
        return Proposal(tree=_chain_tree(self.trees, len(follow), self.device), tokens=chain_tokens, is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass


class Hybrid:
    """Medusa heads and prompt lookup verified together in one target pass.

    The heads' static tree and, when the n-gram index finds a match, the lookup chain hang
    side by side off the root; verification keeps the longest accepted path of either. The
    two are complementary: the heads guess short continuations anywhere, the lookup copies
    long spans where the answer repeats the prompt or itself. Where the target's pass costs
    about the same for a few more nodes (GPUs), the chain is nearly free. The chain's nodes
    use rank ``width`` at depth 1 (``width`` = one past the heads' largest rank there), so
    they never collide with the heads' paths; a combined layout is compiled once per chain
    length. Neither part samples, so lossless verification treats every node as a point mass.
    """

    def __init__(self, medusa: MedusaProposer, lookup: PromptLookup, device: torch.device) -> None:
        self.medusa, self.lookup, self.device = medusa, lookup, device
        self.base = list(medusa.tree.paths)
        self.branch = max((p[0] for p in self.base), default=-1) + 1
        self.layouts: dict[int, tuple[TreeBuffers, torch.Tensor, torch.Tensor]] = {}

    def _layout(self, k: int) -> tuple[TreeBuffers, torch.Tensor, torch.Tensor]:
        """The tree for a ``k``-token chain, and where the heads' and the chain's nodes go in it."""
        if k not in self.layouts:
            chain_paths = [(self.branch,) + (0,) * d for d in range(k)]
            tree = compile_tree(self.base + chain_paths)
            index = {path: i + 1 for i, path in enumerate(tree.paths)}
            heads_nodes = torch.tensor([0] + [index[path] for path in self.medusa.tree.paths], dtype=torch.long)
            chain_nodes = torch.tensor([index[path] for path in chain_paths], dtype=torch.long)
            self.layouts[k] = (tree.to(self.device), heads_nodes.to(self.device), chain_nodes.to(self.device))
        return self.layouts[k]

    def begin(self, state: DecodeState) -> None:
        self.medusa.begin(state)
        self.lookup.begin(state)

    def propose(self, state: DecodeState) -> Proposal:
        copied = self.lookup.propose(state)
        k = copied.tokens.numel() - 1
        if not self.base:  # a calibrated tree may be empty: then this is plain lookup
            return copied
        guessed = self.medusa.propose(state)
        if k == 0:
            return guessed
        tree, heads_nodes, chain_nodes = self._layout(k)
        tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=self.device)
        tokens[heads_nodes] = guessed.tokens.long()
        tokens[chain_nodes] = copied.tokens[1:].long()
        return Proposal(tree=tree, tokens=tokens)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        self.medusa.update(state, outcome)
        self.lookup.update(state, outcome)
