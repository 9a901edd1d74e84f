"""Proposers: what drafts the candidate tree the target verifies.

Every decoding mode is one proposer behind the same engine loop:

* ``Autoregressive`` - no candidates, the root alone (plain decoding, the baseline);
* ``MedusaProposer`` - the heads' top-k laid out by a static tree;
* ``DraftModel`` - a small causal LM drafting a chain token by token;
* ``PromptLookup`` - a chain copied from where the latest n-gram occurred before;
* ``EagleProposer`` / ``BlockProposer`` - EAGLE heads' dynamic tree, block heads' one-pass
  chain (:mod:`medusa.decoding.eagle_draft`, :mod:`medusa.decoding.block_draft`);
* ``Hybrid`` - the heads' tree and the lookup chain side by side in one tree
  (:mod:`medusa.decoding.hybrid`);
* ``LookaheadProposer`` - n-grams from the target's own Jacobi iterations
  (:mod:`medusa.decoding.lookahead`).

A proposer answers ``propose(state) -> Proposal`` and hears the outcome through
``update(state, outcome)``; it keeps whatever state it needs (a draft model's cache, an
n-gram index) to itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from medusa.decoding.block_draft import BlockProposer, block_size_for
from medusa.decoding.eagle_draft import DynamicTree, EagleProposer
from medusa.decoding.hybrid import Hybrid
from medusa.decoding.lookahead import LookaheadProposer, LookaheadSize, size_lookahead
from medusa.decoding.sampling import probabilities, sample
from medusa.decoding.state import DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import TreeBuffers, chain, compile_tree
from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads
from medusa.models.kinds import KINDS, kind
from medusa.models.target import context_window
from medusa.runtime import hf as kv
from medusa.runtime.ngrams import NgramTable


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


class MedusaProposer(Proposer):
    """Medusa heads proposing the top-k of each head, arranged by a static tree."""

    def __init__(self, heads: MedusaHeads, paths: list[tuple[int, ...]], device: torch.device) -> None:
        tree = compile_tree(paths)
        if tree.max_depth > heads.num_heads:
            raise ValueError(f"tree is {tree.max_depth} deep but there are only {heads.num_heads} heads")
        self.heads = heads
        self.device = device
        self.tree = tree.to(device)
        self.max_rows = self.min_rows = tree.num_nodes
        self.width = max(tree.topk, default=1)
        # the tree cut to each depth the token budget allows, built once per depth:
        # depth -> (tree, candidate index [N-1] into the flattened [D, width] top-k, is_chain)
        self.layouts: dict[int, tuple[TreeBuffers, torch.Tensor, bool]] = {}

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
        tree, candidate_index, is_chain = self._layout(state.max_depth(self.tree.max_depth))
        if tree.max_depth == 0:  # a calibrated tree may say heads do not pay here, or one token is left
            return Proposal(tree=tree, tokens=state.root.view(1), is_chain=True)
        top = self.heads.topk(state.hidden, self.width, num_heads=tree.max_depth)  # [D, width]
        tokens = torch.cat([state.root.view(1), top.reshape(-1)[candidate_index]])
        return Proposal(tree=tree, tokens=tokens, is_chain=is_chain)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass

    def describe(self) -> str:
        return f"static tree ({self.tree.num_nodes} nodes, depth {self.tree.max_depth})"


def _chain_tree(trees: dict[int, TreeBuffers], k: int, device: torch.device) -> TreeBuffers:
    """The compiled chain of ``k`` candidates, built once per length."""
    if k not in trees:
        trees[k] = compile_tree(chain(k)).to(device)
    return trees[k]


class DraftModel(Proposer):
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

    @property
    def max_rows(self) -> int:
        return 1 + (self.max_tokens if self.adaptive else self.k)

    @property
    def min_rows(self) -> int:
        return 1 if self.adaptive else 1 + self.k

    def describe(self) -> str:
        how = f"up to {self.max_tokens}, fewer when unsure" if self.adaptive else f"{self.k}"
        return f"draft model chain ({how} tokens)"

    def begin(self, state: DecodeState) -> None:
        self.cache = kv.new_cache()
        self.cached = []
        self.pending = None

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Proposal:
        n, total = len(self.cached), len(state.tokens)
        # The draft writes positions n .. total + k - 2; stay inside its context window, and
        # draft no more than the token budget can still emit.
        k = state.max_depth(self.k if self.window is None else min(self.k, self.window - total + 1))
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
                for i in range(state.max_depth(self.k)):
                    j = end + i
                    follow.append(tokens[j] if j < total else follow[j - total])
                break
        if not follow and self.table is not None:
            follow = self.table.chain(tokens, state.max_depth(self.k))
        chain_tokens = torch.tensor(tokens[-1:] + follow, device=self.device)  # [1 + k]: the root, then the copy
        return Proposal(tree=_chain_tree(self.trees, len(follow), self.device), tokens=chain_tokens, is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        pass


def _lookahead(device: torch.device, config: ProposerConfig, size, max_rows: int | None) -> Proposer:
    """Mode lookahead: ``size`` (sized for the machine) or the device's default, then the config's W, N, G."""
    size = size or size_lookahead(None, device.type, max_rows)
    asked = {"window": config.lookahead_window, "ngram": config.lookahead_ngram, "guesses": config.lookahead_guesses}
    if any(v is not None for v in asked.values()):
        size = LookaheadSize(**{k: getattr(size, k) if v is None else v for k, v in asked.items()}, reason="as set")
    return LookaheadProposer(device, size, text=config.lookahead_text)


MODES = ("baseline", *KINDS, "draft", "lookup", "hybrid", "lookahead")
HEADS_MODES = KINDS  # the modes named after a heads kind (each needs heads of it)
LOOKUP_TOKENS = 8  # tokens a lookup chain copies after a match, unless set or sized


@dataclass(frozen=True)
class ProposerConfig:
    """The per-mode settings, in one place: the engine, ``medusa.load``, the bench and the
    chat take their defaults from here."""

    draft_tokens: int = 4  # mode "draft": tokens drafted per step
    adaptive_draft: bool = False  # grow/shrink draft_tokens per step by acceptance
    # > 0: end a draft chain after a token the draft gave less probability (0.4: transformers' default)
    draft_confidence: float = 0.4
    # modes "lookup"/"hybrid": tokens copied after a match (None: LOOKUP_TOKENS, or for hybrid with
    # eagle or block heads the chain length sized with their tree for this device, medusa/autotune/sizing.py)
    lookup_tokens: int | None = None
    lookup_ngram: int = 3  # longest n-gram looked up
    # mode hybrid: where the text has no match, draft the chain from the heads folder's n-gram
    # table of the target's answers (medusa/runtime/ngrams.py), if it has one
    answer_ngrams: bool = True
    # mode lookahead: window columns W, n-gram size N, n-grams verified per pass G (None: sized
    # for this machine, medusa/decoding/lookahead.py), and whether the text's n-grams join the pool
    lookahead_window: int | None = None
    lookahead_ngram: int | None = None
    lookahead_guesses: int | None = None
    lookahead_text: bool = True
    # mode hybrid: also run lookahead's window and verify its pool's n-grams in the same pass
    hybrid_lookahead: bool = False

    def chain(self, sized: int | None = None) -> int:
        """The lookup chain's length: as set, else ``sized`` (a hybrid tree's), else LOOKUP_TOKENS."""
        return self.lookup_tokens or sized or LOOKUP_TOKENS


def _heads_proposer(heads, device: torch.device, config: ProposerConfig, paths: list[tuple[int, ...]] | None,
                    size: DynamicTree | None, dtype: torch.dtype, hybrid: bool) -> tuple[Proposer, int]:
    """The heads' own proposer (Medusa's static tree, EAGLE's dynamic tree, the block's chain)
    and the lookup chain's length mode hybrid puts beside it (0: none, as sized)."""
    facts = kind(heads.config.kind)
    if not facts.drafts_per_step:
        return MedusaProposer(heads, paths or [], device), config.chain()
    if not facts.dynamic_tree:  # a block's chain and siblings
        size = size or block_size_for(heads, device, dtype, hybrid=hybrid)
        guessed: Proposer = BlockProposer(heads, device, size=size, dtype=dtype)
    else:
        size = size or DynamicTree.for_device(heads.dynamic, device, dtype, hybrid=hybrid)
        guessed = EagleProposer(heads, device, size=size, dtype=dtype)
    chain = config.chain(size.chain)
    return guessed, 0 if hybrid and size.chain == 0 and not config.lookup_tokens else chain


def make_proposer(
    mode: str,
    device: torch.device,
    config: ProposerConfig,
    heads: MedusaHeads | None = None,
    paths: list[tuple[int, ...]] | None = None,
    draft: PreTrainedModel | None = None,
    dtype: torch.dtype = torch.float32,
    size=None,
    max_rows: int | None = None,
    lookahead: LookaheadSize | None = None,
) -> Proposer:
    """The proposer for a mode name; ``paths`` is the heads' tree (modes medusa and hybrid);
    ``dtype`` the target's (eagle heads take the dynamic tree calibrated for it, or ``size``,
    a :class:`~medusa.decoding.eagle_draft.DynamicTree`, with mode hybrid's lookup chain; block heads
    take one too, their chain and siblings, :mod:`medusa.decoding.block_draft`; mode
    lookahead a :class:`~medusa.decoding.lookahead.LookaheadSize`, else its default for the
    device within ``max_rows``, the rows a pass may verify; ``lookahead``: the W, N, G mode hybrid's
    lookahead part takes when ``config.hybrid_lookahead`` asks for it, sized like mode lookahead's)."""
    if mode == "baseline":
        return Autoregressive(device)
    if mode == "lookahead":
        return _lookahead(device, config, size, max_rows)
    if mode in (*HEADS_MODES, "hybrid"):
        if heads is None:
            raise MedusaError(f"mode {mode!r} needs heads: load with heads=FOLDER (or heads='init' for untrained ones)")
        loaded = heads.config.kind
        if mode not in kind(loaded).modes:
            raise MedusaError(f"mode {mode!r} needs {mode} heads, but the loaded heads are {loaded} heads: "
                              f"use mode={loaded!r} (or 'hybrid'), or load {mode} heads")
        guessed, chain = _heads_proposer(heads, device, config, paths, size, dtype, hybrid=mode == "hybrid")
        if mode != "hybrid" or chain == 0:
            return guessed  # chain 0: sized without a lookup chain, its rows cost more than it adds here
        table = heads.ngrams if config.answer_ngrams else None
        jacobi = _lookahead(device, config, lookahead, max_rows) if config.hybrid_lookahead else None
        return Hybrid(guessed, PromptLookup(device, num_tokens=chain, max_ngram=config.lookup_ngram, table=table),
                      device, lookahead=jacobi)
    if mode == "draft":
        if draft is None:
            raise MedusaError("mode 'draft' needs a draft model: load with draft=FOLDER_OR_HUB_ID (or draft='default')")
        return DraftModel(draft, device, num_tokens=config.draft_tokens, adaptive=config.adaptive_draft,
                          max_tokens=max(16, config.draft_tokens), confidence=config.draft_confidence)
    if mode == "lookup":
        return PromptLookup(device, num_tokens=config.chain(), max_ngram=config.lookup_ngram)
    raise MedusaError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
