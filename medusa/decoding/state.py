"""What the decode loop and the proposers pass each other: the state, a proposal, a step's outcome.

Kept apart from :mod:`medusa.decoding.engine` and :mod:`medusa.decoding.proposers` so that
neither imports the other for its types.
"""

from __future__ import annotations

import abc
import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from medusa.decoding.penalties import Penalties
from medusa.decoding.sampling import SamplingConfig
from medusa.decoding.tree import TreeBuffers
from medusa.errors import MedusaError


class CacheShare:
    """The states that hold one KV cache, and which of them owns it.

    Reusing a state (``state=`` of a later generation) continues in its cache. The owner
    (the state of the generation that last took the cache) hands it over without a copy:
    the next generation crops it to the common prefix and writes after it, so every holder
    now trusts only that prefix (its ``valid`` drops to it). A state that is not the owner
    (its cache was taken since) gets a copy of the prefix it still trusts, so branching
    twice from one state is correct and the chat's turn after turn never copies.
    """

    def __init__(self) -> None:
        self.owner: weakref.ref | None = None
        self.holders: list[weakref.ref] = []  # weak: old turns' states may be dropped freely

    def owned_by(self, state: DecodeState) -> bool:
        return self.owner is not None and self.owner() is state

    def narrow(self, start: int) -> None:
        """Every holder trusts at most the first ``start`` positions (a generation is about to
        write after them)."""
        for ref in self.holders:
            holder = ref()
            if holder is not None:
                holder.valid = min(holder.valid, start)

    def take(self, state: DecodeState, start: int) -> None:
        """``state``'s generation keeps the first ``start`` positions and writes after them."""
        self.narrow(start)
        self.holders = [ref for ref in self.holders if ref() is not None] + [weakref.ref(state)]
        self.owner = weakref.ref(state)


@dataclass
class DecodeState:
    """Everything the loop carries between steps.

    ``tokens[:length]`` are in ``cache``; ``tokens[-1]`` is the ``root``: the last token
    emitted, whose KV entry the next pass writes. ``hidden`` ``[H]`` and ``logits`` ``[V]``
    are the target's final hidden state and logits at position ``length - 1`` (the
    position that produced the root). ``sampling`` and ``generator`` are the generation's
    sampling rule and random stream (proposers that sample draw from the same stream).
    ``prefill_hidden`` ``[n, H]`` are the final hidden states of the positions the prefill
    ran (the last ``n`` before ``length``), for proposers that read the target's features.

    ``budget`` is how many tokens the generation may still emit before the length limit or
    the context window (whichever is closer), set before each ``propose``: a step emits at
    most its tree's depth plus one, so proposers draft no deeper than :meth:`max_depth`.
    ``valid`` is how many leading positions of ``cache`` still hold this state's tokens
    (``length`` when its generation ends; less once a later generation reusing the cache
    cropped it), ``share`` records who holds the cache (see :class:`CacheShare`).
    """

    cache: Cache
    tokens: list[int]
    length: int
    root: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: torch.Generator | None = None
    prefill_hidden: torch.Tensor | None = None
    budget: int | None = None
    valid: int = 0
    share: CacheShare | None = None
    carry: dict[str, object] = field(default_factory=dict)
    # a request's adjustments of the target's distribution (medusa/decoding/penalties.py), which
    # count the answer: the tokens from ``prompt_length`` on
    penalties: Penalties | None = None
    prompt_length: int = 0
    # this step drafts without a costly drafter's levels (EAGLE heads; mode hybrid keeps its
    # lookup chain): a batch's choice where they cost more than their rows (medusa/serving/drafting.py)
    lean: bool = False

    def max_depth(self, depth: int) -> int:
        """``depth`` capped to what the budget can still emit (``budget - 1`` drafted tokens)."""
        return depth if self.budget is None else max(0, min(depth, self.budget - 1))


@dataclass(frozen=True)
class StepOutcome:
    """What one verified step accepted: tree ``nodes`` kept (root first), the new
    ``tokens`` emitted, every node's ``hidden`` ``[N, H]`` and the cache length before;
    ``side_logits`` ``[E, V]``: the target's logits at the proposal's side rows, if it had any;
    ``logits`` ``[N, V]``: the target's logits at every node (token ``i`` was chosen at node
    ``nodes[i]``), for the log-probabilities a request may ask for."""

    nodes: list[int]
    tokens: list[int]
    hidden: torch.Tensor
    start: int
    side_logits: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class SideRows:
    """Rows a pass runs after the candidates that are not candidates (mode lookahead's Jacobi
    window): the proposer reads their logits back (``StepOutcome.side_logits``) and their KV
    entries are dropped with the rejected nodes. ``tokens`` ``[E]``, ``depth`` ``[E]`` position
    offsets from the root, ``sees`` ``[E, N + E]`` which rows of the pass (the ``N`` candidates,
    root first, then these) each attends besides the cache; no candidate sees a side row.
    ``reach``: the largest ``depth`` (the context window must hold it)."""

    tokens: torch.Tensor
    depth: torch.Tensor
    sees: torch.Tensor
    reach: int

    def joined(self, tokens: torch.Tensor, depth: torch.Tensor, ancestor: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The candidates' ``tokens`` ``[N]``, ``depth`` ``[N]``, ``ancestor`` ``[N, N]`` with these
        rows appended: ``[N + E]``, ``[N + E]``, ``[N + E, N + E]``."""
        n, e = tokens.shape[0], self.tokens.shape[0]
        grown = torch.zeros(n + e, n + e, dtype=torch.bool, device=ancestor.device)
        grown[:n, :n] = ancestor
        grown[n:] = self.sees
        return torch.cat([tokens, self.tokens]), torch.cat([depth, self.depth]), grown


@dataclass(frozen=True)
class Proposal:
    """A tree of candidates: ``tokens`` ``[N]`` laid out as ``tree`` (root first).

    ``q`` ``[N, V]``, when given, is the distribution each node's token was drawn from
    (row 0, the root, is unused); rules that sample need it, greedy ones do not.
    ``is_chain`` lets the engine use plain causal attention instead of a tree mask.
    ``side``: rows the same pass runs that are not candidates (:class:`SideRows`).
    ``argmax``: only each row's argmax is read (a greedy request without penalties or
    log-probabilities): the pass may screen the vocabulary (medusa/runtime/screen.py).
    """

    tree: TreeBuffers
    tokens: torch.Tensor
    q: torch.Tensor | None = None
    is_chain: bool = False
    side: SideRows | None = None
    argmax: bool = False


class Proposer(abc.ABC):
    """What proposes the candidates a target pass verifies, and what it says of itself.

    Every mode's proposer derives from this class, and the engine, the scheduler, the chat and
    the bench ask only what it declares: ``max_rows`` (the largest proposal, root included;
    None: it does not say, and compiled passes need ``precompile(rows=N)``), ``min_rows`` (the
    smallest but for a budget cut: a compiled pass pads up to it), ``greedy_only`` (it cannot
    verify sampled answers) and :meth:`describe`. An object of another class with ``begin``,
    ``propose`` and ``update`` is used through :func:`as_proposer`.
    """

    max_rows: int | None = None
    min_rows: int = 1
    greedy_only: bool = False

    def begin(self, state: DecodeState) -> None:
        """Called after the prompt is prefilled, before the first ``propose`` (default: nothing)."""
        return None

    @abc.abstractmethod
    def propose(self, state: DecodeState) -> Proposal:
        """This step's candidates: a tree rooted at ``state.root`` and its tokens."""

    def steps(self, state: DecodeState):
        """:meth:`propose` as a coroutine that yields each call of its heads it can share with other
        sequences' (an ``Ask``: medusa/decoding/proposers/shared.py drives it) and returns the
        proposal. Default: it asks nothing."""
        proposal = self.propose(state)
        yield from ()
        return proposal

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        """Called after each verified step with what was accepted (default: nothing)."""
        return None

    def describe(self) -> str:
        """What a proposal is, in a few words (the chat's banner, the bench's notes)."""
        return type(self).__name__


class HeadsProposer(Proposer):
    """A heads kind's proposer (the registry's ``Kind.proposer``, medusa/models/kinds.py): every
    kind's is built by :meth:`for_heads`, one signature for all, and says what sizing asks of it."""

    @classmethod
    @abc.abstractmethod
    def for_heads(cls, heads, device: torch.device, *, size=None, paths: list[tuple[int, ...]] | None = None,
                  dtype: torch.dtype = torch.float32, hybrid: bool = False, draw: int = 1,
                  window: int | None = None) -> HeadsProposer:
        """The proposer of ``heads`` on ``device``: ``size``, its proposal's size where it drafts per
        step (None: the size calibrated for the device and the target's ``dtype``, for mode hybrid
        with ``hybrid``); ``paths``, the static tree where it has one; ``draw``, the candidates per
        depth a sampled request's chain draws from the heads' own distribution (0: their
        deterministic top-k instead, verified as point masses; medusa/decoding/proposers/drawn.py);
        ``window``, the pairs of accepted context a drafter with its own cache attends to at most
        (a sliding window; None: all of it)."""

    @staticmethod
    def shape(depth: int, topk: int):
        """The size of its largest proposal of a ``(depth, topk)`` draft shape (the kinds that draft
        per step: medusa/autotune/sizing.py times it)."""
        raise MedusaError("these heads propose a static tree, which has no draft shape to size per step: "
                          "size heads that draft per step (eagle, eagle3, block)")

    @staticmethod
    def deepest(heads) -> int | None:
        """How deep ``heads`` can draft at most (None: as deep as asked)."""
        return None


class _Foreign(Proposer):
    """A proposer of the caller's own class, which declares what it may (``max_rows``, ...)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.max_rows = getattr(inner, "max_rows", None)
        self.min_rows = getattr(inner, "min_rows", 1)
        self.greedy_only = getattr(inner, "greedy_only", False)

    def begin(self, state: DecodeState) -> None:
        self.inner.begin(state)

    def propose(self, state: DecodeState) -> Proposal:
        return self.inner.propose(state)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        self.inner.update(state, outcome)

    def describe(self) -> str:
        own = getattr(self.inner, "describe", None)
        return own() if callable(own) else type(self.inner).__name__


def as_proposer(obj) -> Proposer:
    """``obj`` as a :class:`Proposer`: itself if it is one, else wrapped (it must have
    ``begin``, ``propose`` and ``update``)."""
    if isinstance(obj, Proposer):
        return obj
    missing = [m for m in ("begin", "propose", "update") if not callable(getattr(obj, m, None))]
    if missing:
        raise MedusaError(f"{type(obj).__name__} is not a proposer (no {', '.join(missing)}): pass a mode name, or "
                          "an object with begin(state), propose(state) and update(state, outcome)")
    return _Foreign(obj)
