"""Drafting with EAGLE heads: a dynamic tree per step (EAGLE-2), verified by the same engine.

Each step the head grows a draft tree by confidence. Depth 1 is the ``topk`` best tokens of
the head's prediction from the last accepted position. At every further depth the ``topk``
nodes of the newest depth with the highest cumulative draft log-probability are expanded
(one head pass over them, each attending to the accepted context and its own ancestors),
each into its ``topk`` best children. Finally the ``nodes`` best nodes of the whole draft by
cumulative log-probability (prefix-closed: a child never scores above its parent) become
the tree the target verifies, as ordinary :class:`~medusa.decoding.tree.TreeBuffers`.

The head's own KV cache holds one pair per accepted position; drafted pairs are dropped
after each proposal, and ``update`` appends the pairs of what the target accepted, with
the target's true features (``StepOutcome.hidden``). Candidates are deterministic (top-k),
so they carry no ``q``: lossless sampling treats each as a point mass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from medusa.decoding.proposers import shared
from medusa.decoding.proposers.drawn import draw, drawn_proposal, draws, nearest
from medusa.decoding.proposers.shared import Ask, Steps
from medusa.decoding.sampling import probabilities
from medusa.decoding.state import DecodeState, HeadsProposer, Proposal, StepOutcome
from medusa.decoding.tree import TreeBuffers, compile_tree, tree_key
from medusa.models.eagle_heads import EagleHeads, additive_mask
from medusa.runtime import drafter
from medusa.runtime import hf as kv

Path_ = tuple[int, ...]


@dataclass(frozen=True)
class DynamicTree:
    """Size of the per-step draft tree: ``nodes`` verified (root excluded), grown to
    ``depth`` levels expanding ``topk`` nodes per level into ``topk`` children each."""

    nodes: int = 8
    depth: int = 5
    topk: int = 4
    chain: int | None = None  # mode hybrid: lookup tokens beside this tree (None: the engine's lookup_tokens)
    # from a cached length on, a smaller size of the same draft shape: ((length, size), ...) in
    # increasing length (medusa/autotune/sizing.py sizes each context length from the pass cost
    # timed there: a row costs more the more tokens it attends to)
    longer: tuple[tuple[int, DynamicTree], ...] = ()

    def at(self, length: int) -> DynamicTree:
        """The size for a step after ``length`` cached tokens."""
        size = self
        for start, smaller in self.longer:
            if length >= start:
                size = smaller
        return size

    @property
    def sizes(self) -> list[DynamicTree]:
        """This size and every smaller one it switches to at longer contexts."""
        return [self] + [size for _, size in self.longer]

    def describe_longer(self) -> str:
        """``"; from 1536 tokens 6 nodes + 2-token chain, ..."`` (empty without longer sizes)."""
        parts = [f"from {start} tokens {size.nodes} nodes" + ("" if size.chain is None else f" + {size.chain}-token chain")
                 for start, size in self.longer]
        return "" if not parts else "; " + ", ".join(parts)

    def as_dict(self) -> dict:
        """The size as a calibration file keeps it (``longer`` only where there are longer sizes)."""
        data = {"nodes": self.nodes, "depth": self.depth, "topk": self.topk, "chain": self.chain}
        if self.longer:
            data["longer"] = [[start, size.as_dict()] for start, size in self.longer]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> DynamicTree:
        """The size :meth:`as_dict` wrote (a mode's entry beside it, ``"hybrid"``, is skipped)."""
        longer = tuple((int(start), cls.from_dict(size)) for start, size in data.get("longer", ()))
        return cls(**{k: v for k, v in data.items() if k not in ("hybrid", "longer")}, longer=longer)

    @classmethod
    def for_device(cls, calibrated: dict[str, dict], device: torch.device,
                   dtype: torch.dtype = torch.float32, hybrid: bool = False) -> DynamicTree:
        """The size calibrated for this device type and the target's dtype (tree.tree_key),
        else for the device type, else a default by device kind (a pass over many tokens costs
        about one pass on a GPU, about twice that on a CPU). ``hybrid``: the size calibrated
        for mode hybrid (an entry's ``"hybrid"``, with its lookup chain), else the same."""
        for key in (tree_key(device.type, dtype), device.type):
            if key in calibrated:
                entry = calibrated[key]
                return cls.from_dict(entry["hybrid"] if hybrid and "hybrid" in entry else entry)
        return cls(nodes=48, depth=6, topk=8) if device.type == "cuda" else cls()


@functools.lru_cache(maxsize=512)
def _compiled(paths: tuple[Path_, ...]) -> TreeBuffers:
    return compile_tree(paths)


def select(paths: list[Path_], scores: list[float], nodes: int) -> list[int]:
    """Indices of the ``nodes`` best draft nodes by cumulative log-probability, prefix-closed.

    ``paths[i]`` is node ``i``'s path of child ranks; a node whose parent is not kept is
    skipped (with exact ties a child could otherwise outrank its parent)."""
    order = sorted(range(len(paths)), key=lambda i: (-scores[i], len(paths[i]), paths[i]))
    kept: list[int] = []
    have: set[Path_] = set()
    for i in order:
        if len(kept) == nodes:
            break
        if len(paths[i]) == 1 or paths[i][:-1] in have:
            kept.append(i)
            have.add(paths[i])
    return kept


class EagleProposer(HeadsProposer):
    """EAGLE heads proposing a dynamic tree each step (see the module docstring)."""

    @classmethod
    def for_heads(cls, heads: EagleHeads, device: torch.device, *, size: DynamicTree | None = None,
                  paths: list[Path_] | None = None, dtype: torch.dtype = torch.float32,
                  hybrid: bool = False, draw: int = 1, window: int | None = None) -> EagleProposer:
        """``size``, else the size calibrated for the device and dtype (mode hybrid's with ``hybrid``)."""
        return cls(heads, device, size or DynamicTree.for_device(heads.dynamic, device, dtype, hybrid=hybrid), dtype,
                   draw, window)

    @staticmethod
    def shape(depth: int, topk: int) -> DynamicTree:
        """``topk`` nodes expanded into ``topk`` children per level: every candidate, ``depth`` deep."""
        return DynamicTree(nodes=depth * topk * topk, depth=depth, topk=topk)

    def __init__(self, heads: EagleHeads, device: torch.device, size: DynamicTree | None = None,
                 dtype: torch.dtype = torch.float32, draw: int = 1, window: int | None = None) -> None:
        """``dtype``: the target's (the pass cost, hence the calibrated tree, depends on it);
        ``draw``: a sampled request's candidates per depth, drawn down a chain (0: the top-k tree);
        ``window``: the accepted pairs the head attends to at most (its cache slides; None: all)."""
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1 pair, got {window}")
        self.heads = heads
        self.device = device
        self.draw = draw
        self.window = window
        self.size = size or DynamicTree.for_device(heads.dynamic, device, dtype)
        # a sampled request's size where it differs (mode hybrid: see sample_with); None: ``size``
        self.sampled: DynamicTree | None = None
        self.active = True  # the head runs for this generation (its size drafts)
        self.cache = kv.new_cache()
        self.length = 0  # pairs in the head's cache: positions 0..length-1 (or from `start`)
        self.start = 0  # position of the first pair the head has seen
        self.last: torch.Tensor | None = None  # [H] the head's prediction of the root's feature
        self.ranked: list[Path_] = []  # the last proposal's nodes, best first
        self.scores: list[float] = []  # and their cumulative draft log-probabilities
        # accepted pairs not yet in the head's cache: lean steps (a batch that does not draft with
        # the head) defer them, and the next step that drafts feeds them in one call (_catch_up)
        self.pending: list[tuple[torch.Tensor, list[int], int]] = []
        # drawn chains sized per calibrated temperature ((temperature, size), ...): a sampled
        # request drafts the one nearest its temperature (medusa/autotune/drawn.py)
        self.by_temperature: tuple[tuple[float, DynamicTree], ...] = ()

    def sample_with(self, size: DynamicTree | None,
                    by_temperature: tuple[tuple[float, DynamicTree], ...] = ()) -> None:
        """Draft sampled requests (whose heads draw their candidates) at ``size`` instead of the
        greedy one: mode hybrid sized its tree by greedy acceptance, where the lookup chain's
        point masses are accepted about as often as the heads' drafts; at a temperature the chain's
        acceptance falls with the target's probability of its token while drawn drafts keep theirs
        (min(1, p/q)), so a sampled request drafts with the heads as mode eagle does.
        ``by_temperature``: chains sized from the heads' drawn calibration, which come first."""
        self.sampled, self.by_temperature = size, tuple(by_temperature)

    def _sizes(self) -> list[DynamicTree]:
        drawn = [s for _, size in self.by_temperature for s in size.sizes]
        return self.size.sizes + ([] if self.sampled is None else self.sampled.sizes) + drawn

    def _size_for(self, state: DecodeState) -> DynamicTree:
        """The size for this request: where its heads draw, the chain calibrated at the nearest
        temperature, else the sampled size; else the greedy one."""
        if not draws(state.sampling, self.draw):
            return self.size
        if self.by_temperature:
            return nearest(self.by_temperature, state.sampling)
        return self.sampled if self.sampled is not None else self.size

    def chain_for(self, state: DecodeState) -> int | None:
        """Mode hybrid's lookup chain beside a drawn chain: the length sized with the request's
        temperature (None: none sized there; the greedy sizing's)."""
        if self.by_temperature and draws(state.sampling, self.draw):
            return self._size_for(state).chain
        return None

    @property
    def max_rows(self) -> int:
        """The largest proposal, root included (Engine.precompile reads it)."""
        return 1 + max(size.nodes for size in self._sizes())

    @property
    def min_rows(self) -> int:
        """The smallest proposal but for a budget cut (a compiled pass pads up to it)."""
        return 1 + min(size.nodes for size in self._sizes())

    @property
    def drafts(self) -> bool:
        """Whether the head runs at all: sized to draft nothing at every context, it never does."""
        return self.max_rows > 1

    def describe(self) -> str:
        size, sampled = self.size, self.sampled
        text = f"dynamic tree ({size.nodes} nodes, depth {size.depth}, top-{size.topk}{size.describe_longer()})"
        if sampled is None or sampled == size:
            return text
        return f"{text}; sampled requests: a drawn chain within {sampled.nodes} nodes, depth {sampled.depth}"

    # -- the head's cache of accepted pairs ---------------------------------------------
    def _new_cache(self):
        """The head's cache: the one-call drafter's (medusa/runtime/drafter.py) where it runs the
        head's layer now, else the modules' dynamic cache."""
        table = drafter.table(self.heads)
        return kv.new_cache() if table is None else drafter.DraftCache(table.kv_heads, table.dim)

    def _layer(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """The head's layer on new pairs that see the cache positions ``visible`` ``[T, past + T]``
        (their own included), appended to the head's cache: the one-call drafter, or the modules."""
        if isinstance(self.cache, drafter.DraftCache):
            table = drafter.table(self.heads)
            if table is not None:
                return drafter.step(self.heads, table, features, tokens, positions, self.cache, visible)
            self.cache = self.cache.module_cache(self.heads.fc.weight.dtype)  # its packed copies are gone
        return self.heads(features, tokens, positions, self.cache, additive_mask(visible, self.heads.fc.weight.dtype))

    def _crop(self) -> None:
        """Drafted pairs leave the head's cache."""
        if isinstance(self.cache, drafter.DraftCache):
            self.cache.crop(self.length - self.start)
        else:
            kv.crop(self.cache, self.length - self.start)

    def _feed(self, features: torch.Tensor, tokens: list[int], first: int) -> None:
        """Append pairs ``(features[i], tokens[i])`` at positions ``first + i``."""
        shared.alone(self._feed_steps(features, tokens, first))

    def _feed_steps(self, features: torch.Tensor, tokens: list[int], first: int) -> Steps:
        n = len(tokens)
        past = self.length - self.start
        visible = torch.ones(n, past + n, dtype=torch.bool, device=self.device)
        visible[:, past:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        out, _ = yield Ask(self, (features, torch.tensor(tokens, device=self.device),
                                  torch.arange(first, first + n, device=self.device), visible))
        self.length = first + n
        self.last = out[-1]

    @torch.inference_mode()  # the head's cache buffers are inference tensors (propose may regrow them)
    def begin(self, state: DecodeState) -> None:
        # sized to draft nothing for this request from its prompt's length on (a long prompt past
        # the last size that drafts): the head never runs, not even over the prompt's pairs
        self.active = self._drafts_from(state)
        if not self.active:
            return
        # The prefill's features f_p with the tokens x_{p+1} that followed (the last one is
        # the root). A reused state prefilled only its new tokens: the head sees those.
        hidden = state.prefill_hidden
        if self.window is not None:
            hidden = hidden[-self.window:]  # a window: only the prompt's last pairs
        self.pending = []
        self._restart(hidden, state.tokens[state.length + 1 - hidden.shape[0]: state.length + 1],
                      state.length - hidden.shape[0])

    def _restart(self, features: torch.Tensor, tokens: list[int], first: int) -> None:
        """A fresh cache of the pairs ``(features[i], tokens[i])`` at positions ``first + i``."""
        shared.alone(self._restart_steps(features, tokens, first))

    def _restart_steps(self, features: torch.Tensor, tokens: list[int], first: int) -> Steps:
        self.cache = self._new_cache()
        self.start = self.length = first
        yield from self._feed_steps(features, tokens, first)

    def _catch_up(self) -> None:
        """Feed the deferred pairs in one call: within a window only its last pairs, into a fresh
        cache (the older ones would have slid out before this step)."""
        shared.alone(self._catch_up_steps())

    def _catch_up_steps(self) -> Steps:
        if not self.pending:
            return
        if len(self.pending) == 1:  # a drafting step's own pairs (every step, alone): no copy
            features, tokens, first = self.pending[0]
        else:
            features = torch.cat([f for f, _, _ in self.pending])
            tokens = [t for _, ts, _ in self.pending for t in ts]
            first = self.pending[0][2]
        self.pending = []
        if self.window is not None and features.shape[0] >= self.window:
            cut = features.shape[0] - self.window
            yield from self._restart_steps(features[cut:], tokens[cut:], first + cut)
            return
        yield from self._feed_steps(features, tokens, first)
        self._slide()

    # -- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Proposal:
        return shared.alone(self.steps(state))

    @torch.inference_mode()
    def steps(self, state: DecodeState) -> Steps:
        """:meth:`propose` asking for its heads' calls (medusa/decoding/proposers/shared.py): the
        update's pairs, then each level of the tree, shared with other sequences' in a batch."""
        size = self._size_for(state).at(state.length)  # smaller at long contexts (the draft shape's topk is the same)
        depth = state.max_depth(size.depth)  # no deeper than the tokens left to emit
        if size.nodes == 0 or depth == 0 or state.lean:  # drafting does not pay here; or one token is left
            self.ranked, self.scores = [], []
            return Proposal(tree=_compiled(()).to(self.device), tokens=state.root.view(1), is_chain=True)
        yield from self._catch_up_steps()
        if draws(state.sampling, self.draw):  # levels as deep as sized, within its nodes
            width = max(size.topk, 1) if self.by_temperature else self.draw  # (calibrated: siblings as sized)
            return self._drawn(state, min(depth, max(1, size.nodes // width)), width)
        parents, tokens, scores = yield from self._draft(state.length, depth)
        self._crop()
        # the drafting's host sync: what was drafted, once every level is queued
        token_list, score_list = torch.cat(tokens).tolist(), torch.cat(scores).tolist()
        parent_lists = [[0]] + [p.tolist() for p in parents]
        paths: list[Path_] = []
        level: list[Path_] = [()]
        for up in parent_lists:  # level d's nodes: topk ranked children of each listed node of level d-1
            level = [level[p] + (r,) for p in up for r in range(size.topk)]
            paths += level
        keep = select(paths, score_list, min(size.nodes, len(paths)))
        self.ranked = [paths[i] for i in keep]  # best first (calibration reads it)
        self.scores = [score_list[i] for i in keep]  # their cumulative draft log-probabilities
        tree = _compiled(tuple(sorted(self.ranked, key=lambda p: (len(p), p)))).to(self.device)
        index = {p: i for i, p in enumerate(paths)}
        drafted = torch.tensor([token_list[index[p]] for p in tree.paths], device=self.device)
        return Proposal(tree=tree, tokens=torch.cat([state.root.view(1), drafted]))

    def _drawn(self, state: DecodeState, depth: int, width: int) -> Proposal:
        """A sampled request's chain: at each depth ``width`` candidates drawn from the head's
        processed distribution; the head then runs on the first one to guess the next depth."""
        root, past = state.length, state.length - self.start
        feature, levels = self.last, []
        for d in range(depth):
            logits = self.heads.logits(feature, self.heads.draft_vocab).float()  # [S or V]
            levels.append(draw(logits, state.sampling, width, state.generator, self.heads.draft_vocab,
                               self.heads.config.vocab_size))
            if d + 1 < depth:  # the chain's node sees the accepted context and the chain above it
                visible = torch.ones(1, past + d + 1, dtype=torch.bool, device=self.device)
                feature = self._layer(feature[None], levels[-1][0][:1], torch.full((1,), root + d, device=self.device),
                                      visible)[0]
        self._crop()
        proposal = drawn_proposal(state.root, levels)
        self.ranked, self.scores = list(proposal.tree.paths), []
        return proposal

    @torch.inference_mode()
    def chain_laws(self, state: DecodeState, tokens: list[int]) -> list[torch.Tensor]:
        """The head's processed laws (``state.sampling`` applied, over its draft vocabulary) at
        depths 1..len(tokens) of a chain that drew ``tokens``: what :meth:`_drawn` draws from, with
        the tokens given (teacher forcing, for the drawn calibration: medusa/autotune/drawn.py)."""
        self._catch_up()
        root, past = state.length, state.length - self.start
        feature, laws = self.last, []
        for d, token in enumerate(tokens):
            laws.append(probabilities(self.heads.logits(feature, self.heads.draft_vocab).float(), state.sampling))
            if d + 1 < len(tokens):
                visible = torch.ones(1, past + d + 1, dtype=torch.bool, device=self.device)
                feature = self._layer(feature[None], torch.tensor([token], device=self.device),
                                      torch.full((1,), root + d, device=self.device), visible)[0]
        self._crop()
        return laws

    def _draft(self, root: int, depth: int) -> Steps:
        """Grow the draft to ``depth`` levels, returning ``(parents, tokens, scores)``, per level the
        nodes' draft tokens and cumulative log-probabilities; level d's nodes are the ``topk``
        ranked children of each node of level d-1 listed in ``parents[d - 2]`` (level 1: of
        the root). Fixed shapes and no host sync: ``topk`` nodes at level 1, ``topk * topk``
        below, and the ``topk`` best of a level are expanded by one head pass over them."""
        k, past = self.size.topk, root - self.start
        _, logp = yield Ask(self, features=self.last, scored=True)  # [V or S]
        vocab = self.heads.draft_vocab  # read after scoring: logits() keeps it on the projection's device
        top = logp.topk(k)
        tokens = [top.indices if vocab is None else vocab[top.indices]]  # [k]
        scores, features = [top.values], self.last.expand(k, -1)  # [k], [k, H]: the feature that drafted them
        ancestors = torch.zeros(k, 0, dtype=torch.long, device=self.device)  # their ancestors' drafted pairs
        parents: list[torch.Tensor] = []
        rows = torch.arange(k, device=self.device)
        for d in range(1, depth):
            best = scores[-1].topk(k).indices  # [k] the best nodes of the newest level, best first
            drafted = (d - 1) * k  # pairs the levels above put in the head's cache
            visible = torch.zeros(k, past + drafted + k, dtype=torch.bool, device=self.device)
            visible[:, :past] = True  # the accepted context
            visible.scatter_(1, past + ancestors[best], True)  # the node's ancestors' pairs
            visible[rows, past + drafted + rows] = True  # and its own
            out, logp = yield Ask(self, (features[best], tokens[-1][best],
                                         torch.full((k,), root + d - 1, device=self.device), visible), scored=True)
            top = logp.topk(k, dim=-1)  # [k, k]: out [k, H], the next level's features
            tokens.append((top.indices if vocab is None else vocab[top.indices]).flatten())  # parent-major
            scores.append((top.values + scores[-1][best][:, None]).flatten())
            features = out.repeat_interleave(k, 0)
            ancestors = torch.cat([ancestors[best], (drafted + rows)[:, None]], 1).repeat_interleave(k, 0)
            parents.append(best)
        return parents, tokens, scores

    @torch.inference_mode()
    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        if not self.active:
            return
        if not self._drafts_from(state):  # sized to draft nothing from here on: the head rests
            self.active, self.pending = False, []
            return
        # pairs (f_p, x_{p+1}) for the root and every accepted node, with the target's features
        nodes = torch.tensor(outcome.nodes, device=self.device)
        self.pending.append((outcome.hidden[nodes], list(outcome.tokens), outcome.start))
        if state.lean:  # a batch's lean step: fed when the head next drafts
            waiting = outcome.start + len(outcome.tokens) - self.pending[0][2]  # pairs, contiguous positions
            if self.window is not None and waiting > 2 * self.window:
                self._catch_up()  # (at most two windows wait)
            return
        self._catch_up()

    def _drafts_from(self, state: DecodeState) -> bool:
        """Whether a size of this request drafts at its length or at a longer one (contexts only grow)."""
        size = self._size_for(state)
        return size.at(state.length).nodes > 0 or any(s.nodes for start, s in size.longer if start > state.length)

    def _slide(self) -> None:
        """The oldest pairs leave the head's cache past its window."""
        excess = self.length - self.start - (self.window or self.length)
        if excess > 0:  # the window slides: the oldest pairs leave the head's cache
            if isinstance(self.cache, drafter.DraftCache):
                self.cache.drop_front(excess)
            else:
                kv.drop_front(self.cache, excess)
            self.start += excess
