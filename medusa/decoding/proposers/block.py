"""Drafting with block heads (``kind: block``): ``k`` tokens in one drafter pass (DFlash-style).

A block drafter reads the target's fused multi-layer features (the ``feature_layers`` the
engine's passes already return for EAGLE-3 heads) of every *verified* position as keys and
values, and scores the next ``k`` tokens after the root in one pass: with ``t`` the last
verified position and the root ``x_{t+1}``, output ``i`` scores ``x_{t+2+i}``. Its context
holds verified positions only, so a rejected draft needs no rollback: ``update`` appends the
accepted positions' features, nothing is cropped.

The proposal is built from the per-position top-``topk`` of that one pass: the top-1 chain
(each depth's best token) and, with ``topk`` > 1, siblings at a depth (its runner-up tokens,
leaves: the block drafted deeper positions after the top-1 token only). Nodes are ranked by
cumulative draft log-probability (the chain to depth ``d - 1`` plus the node's own score) and
the ``nodes`` best, prefix-closed, are verified, sized as an EAGLE tree is
(:class:`~medusa.decoding.proposers.eagle.DynamicTree`: ``depth`` the chain's length, ``topk`` the
candidates per depth, ``nodes`` the budget; medusa/autotune/sizing.py sizes it from this
machine's pass costs; without calibration :func:`block_size_for` picks). With ``topk`` 1 the
proposal is the chain of ``min(nodes, depth)`` tokens, and drafting reads nothing back to the
host: the engine's one sync per step reads the drafted ids with the verification's outcome.

Capture-ready structure (for a CUDA graph; no graph is captured here): a step's drafting work -
the buffer write of the accepted positions' features (``update``, in chunks of a fixed
``1 + k`` rows), the drafter pass over the fixed-capacity context buffer (unused slots masked
by ``ctx_valid``) and the top-k (:meth:`BlockProposer.draft_step`) - has fixed shapes and no
host sync. The only host reads are the drafted ids and scores when ``topk`` > 1 (to select
the tree). The buffer grows by doubling when full; that (rare) regrowth changes its shape. Candidates are deterministic (top-k), so they carry no
``q``: lossless sampling treats each as a point mass, as for EAGLE heads.
"""

from __future__ import annotations

import torch
from torch import nn

from medusa.decoding.proposers import shared
from medusa.decoding.proposers.drawn import draw, drawn_proposal, draws, nearest, siblings_paths
from medusa.decoding.proposers.eagle import DynamicTree, _compiled, select
from medusa.decoding.proposers.shared import Steps
from medusa.decoding.sampling import probabilities
from medusa.decoding.state import DecodeState, HeadsProposer, Proposal, StepOutcome
from medusa.decoding.tree import chain, tree_key

INITIAL_CAPACITY = 256  # context slots allocated per drafter layer before the first doubling
DEFAULT_TOPK = 4  # candidates per depth of an uncalibrated proposal off CUDA (block_size_for)

Path_ = tuple[int, ...]


def block_size_for(heads: nn.Module, device: torch.device, dtype: torch.dtype = torch.float32,
                   hybrid: bool = False) -> DynamicTree:
    """The proposal size calibrated for these heads on this device (``heads.dynamic``, as for
    EAGLE heads; a pass-cost sizing of the plan replaces it, medusa/autotune/sizing.py), else
    ``k`` nodes (the rows of the block's whole chain): on a CUDA device the top-1 chain, whose
    drafting reads nothing back to the host (capture-ready); elsewhere the ``k`` best of the
    top-``DEFAULT_TOPK`` per depth, which accept more tokens per pass at those rows
    (docs/benchmarks/2026-11-29-epyc-zen4-gemma3-block-bench.json)."""
    calibrated = getattr(heads, "dynamic", None) or {}
    if any(key in calibrated for key in (tree_key(device.type, dtype), device.type)):
        return DynamicTree.for_device(calibrated, device, dtype, hybrid=hybrid)
    k = heads.block_size
    return DynamicTree(nodes=k, depth=k, topk=1 if device.type == "cuda" else DEFAULT_TOPK)


def block_paths(depth: int, topk: int) -> list[Path_]:
    """Every candidate node of a ``depth x topk`` block draft, depth-major: ``(0,) * (d - 1) + (r,)``
    is the rank-``r`` token at depth ``d`` under the top-1 chain (flat index ``(d - 1) * topk + r``)."""
    return siblings_paths((topk,) * depth)


class BlockProposer(HeadsProposer):
    """Block heads proposing the top-1 chain of one drafter pass, with siblings (see the module docstring)."""

    @classmethod
    def for_heads(cls, heads: nn.Module, device: torch.device, *, size: DynamicTree | None = None,
                  paths: list[Path_] | None = None, dtype: torch.dtype = torch.float32,
                  hybrid: bool = False, draw: int = 1, window: int | None = None) -> BlockProposer:
        """``size``, else the size calibrated for the device and dtype, else the block's default."""
        return cls(heads, device, size=size or block_size_for(heads, device, dtype, hybrid=hybrid), dtype=dtype,
                   draw=draw)

    @staticmethod
    def shape(depth: int, topk: int) -> DynamicTree:
        """``topk`` candidates at each of ``depth`` positions of the block."""
        return DynamicTree(nodes=depth * topk, depth=depth, topk=topk)

    @staticmethod
    def deepest(heads: nn.Module) -> int:
        return heads.config.num_heads  # a block drafts no deeper than its k tokens

    def __init__(self, heads: nn.Module, device: torch.device, size: DynamicTree | None = None,
                 dtype: torch.dtype = torch.float32, capacity: int = INITIAL_CAPACITY, draw: int = 1) -> None:
        """``dtype``: the target's (calibrated sizes depend on it); ``capacity``: the context
        buffer's first size in slots (it doubles when full); ``draw``: a sampled request's
        candidates per depth, drawn from the block's distribution at that depth (0: its top-k)."""
        self.heads = heads
        self.device = device
        self.draw = draw
        self.size = size or block_size_for(heads, device, dtype)
        self.k = heads.block_size
        self.depth = min(self.size.depth, self.k)
        self.topk = max(1, self.size.topk)
        self.nodes = min(self.size.nodes, self.depth * self.topk)
        self.rows = 1 + self.k  # a buffer write's fixed chunk: the most a block step accepts
        self.capacity = capacity
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per drafter layer [1, kv_heads, C, head_dim]
        self.used = 0  # context slots holding verified positions (the first `used`)
        self.ranked: list[Path_] = []  # the last proposal's nodes, best first (calibration reads it)
        self.scores: list[float] = []  # and their cumulative draft log-probabilities (topk > 1 only)
        # drawn chains sized per calibrated temperature ((temperature, size), ...): a sampled
        # request draws a chain as deep as the one nearest its temperature (medusa/autotune/drawn.py)
        self.by_temperature: tuple = ()

    def sample_with(self, size, by_temperature: tuple = ()) -> None:
        """Draw sampled requests' chains as deep as calibrated at the nearest temperature
        (``by_temperature``); ``size`` (mode hybrid's EAGLE size) does not apply to block heads."""
        self.by_temperature = tuple(by_temperature)

    @property
    def max_rows(self) -> int:
        """The largest proposal, root included (Engine.precompile reads it)."""
        return 1 + max(self._all_nodes())

    @property
    def min_rows(self) -> int:
        """The smallest proposal but for a budget cut (a compiled pass pads up to it)."""
        return 1 + min(self._all_nodes())

    def _all_nodes(self) -> list[int]:
        drawn = [self._drawn_nodes(size) for _, sized in self.by_temperature for size in sized.sizes]
        return [self._nodes(size) for size in self.size.sizes] + drawn

    def _drawn_nodes(self, size: DynamicTree) -> int:
        """Nodes drawn levels of ``size`` verify at most (``size.topk`` candidates a depth)."""
        return min(size.nodes, min(size.depth, self.k) * max(size.topk, 1))

    def _nodes(self, size: DynamicTree) -> int:
        """Nodes a step of ``size`` verifies at most (its depth within the block's and this draft's)."""
        return min(size.nodes, min(size.depth, self.depth) * self.topk)

    def describe(self) -> str:
        text = (f"top-1 chain of {self.nodes}" if self.topk == 1
                else f"{self.nodes} nodes (chain {self.depth} deep, top-{self.topk} per depth)")
        return text + self.size.describe_longer()

    # -- the context buffer of verified positions ---------------------------------------
    def _ensure(self, need: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Room for ``need`` slots: allocate (shaped ``like`` the drafter's K/V) or double."""
        if self.kv and need <= self.kv[0][0].shape[2]:
            return
        size = self.kv[0][0].shape[2] if self.kv else self.capacity
        while size < need:
            size *= 2
        grown = []
        for i, (k, v) in enumerate(like):
            nk = k.new_zeros(k.shape[0], k.shape[1], size, k.shape[3])
            nv = v.new_zeros(v.shape[0], v.shape[1], size, v.shape[3])
            if self.kv:
                nk[:, :, : self.used] = self.kv[i][0][:, :, : self.used]
                nv[:, :, : self.used] = self.kv[i][1][:, :, : self.used]
            grown.append((nk, nv))
        self.kv = grown

    def append(self, features: torch.Tensor, first: int, chunk: int | None = None) -> None:
        """Append ``features`` ``[n, L*H]`` (positions ``first ..``) in chunks of ``chunk`` rows
        (default ``1 + k``: fixed shapes), the last one zero-padded: padded slots lie past
        ``used`` (masked, overwritten next). No host sync."""
        chunk = chunk or self.rows
        n = features.shape[0]
        for s in range(0, n, chunk):
            part = features[s: s + chunk]
            m = part.shape[0]
            if m < chunk:
                part = torch.cat([part, part.new_zeros(chunk - m, part.shape[1])])
            positions = torch.arange(first + s, first + s + chunk, device=self.device)[None]  # [1, chunk]
            kvs = self.heads.context_kv(self.heads.fuse(part[None]), positions)  # per layer ([1, kvh, chunk, hd], ..)
            self._ensure(self.used + chunk, kvs)
            slots = torch.arange(self.used, self.used + chunk, device=self.device)
            for (kb, vb), (k, v) in zip(self.kv, kvs):
                kb.index_copy_(2, slots, k.to(kb.dtype))
                vb.index_copy_(2, slots, v.to(vb.dtype))
            self.used += m

    @torch.inference_mode()
    def begin(self, state: DecodeState) -> None:
        self.kv, self.used = [], 0
        if self.max_rows == 1:  # sized to draft nothing here: the drafter never runs
            return
        # The prefill's verified positions (a reused state prefilled only its new tokens: the
        # drafter sees those), written at once: the prefill is one-off, not a captured step.
        hidden = state.prefill_hidden
        self.append(hidden, state.length - hidden.shape[0], max(hidden.shape[0], 1))

    # -- drafting -----------------------------------------------------------------------
    def draft_step(self, root: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape draft: one drafter pass over the context buffer, the top-``topk`` per
        depth. ``root`` ``[]`` (the target's id), ``position`` ``[1]`` its position. Returns target
        ids ``[depth, topk]`` and cumulative draft log-probabilities ``[depth, topk]`` of the
        candidate nodes (:func:`block_paths`' order). No host sync: every shape is fixed by the
        buffer's capacity, ``k`` and ``topk``."""
        return self._ranks(self._logits(root, position))

    def _ranks(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`draft_step`'s candidates from the pass's logits ``[depth, S]``."""
        top = torch.log_softmax(logits.float(), dim=-1).topk(self.topk, dim=-1)  # [depth, topk]
        chain_logp = top.values[:, 0].cumsum(0)  # [depth] the top-1 chain's cumulative score
        above = torch.cat([chain_logp.new_zeros(1), chain_logp[:-1]])  # [depth] the parent's
        return self.heads.to_target(top.indices), above[:, None] + top.values

    def _logits(self, root: torch.Tensor, position: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """One drafter pass over the context buffer: ``[depth, S]`` logits over the draft
        vocabulary (``depth``: the first that many positions of the block; default the draft's)."""
        return self.heads.draft(root.view(1), position, self.kv, self.valid())[0, : self.depth if depth is None else depth]

    def valid(self) -> torch.Tensor:
        """``[1, C]``: which slots of the context buffer hold verified positions."""
        return torch.arange(self.kv[0][0].shape[2], device=self.device)[None] < self.used

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Proposal:
        return shared.alone(self.steps(state))

    @torch.inference_mode()
    def steps(self, state: DecodeState) -> Steps:
        """:meth:`propose` asking for its drafter pass (medusa/decoding/proposers/shared.py: a batch's
        sequences' passes share their products where each gets its own bits there)."""
        drawn = draws(state.sampling, self.draw)
        sized = nearest(self.by_temperature, state.sampling) if drawn else None
        if sized is not None:  # a chain as deep as calibrated at the request's temperature
            return self._drawn(state, state.max_depth(min(sized.depth, self.k)) if sized.nodes else 0,
                               max(sized.topk, 1))
        size = self.size.at(state.length)  # smaller at long contexts (the same draft shape)
        nodes = self._nodes(size)
        depth = state.max_depth(min(size.depth, self.depth))  # no deeper than the tokens left to emit
        if nodes == 0 or depth == 0:
            return self._drawn(state, 0, 1)
        if drawn:  # each depth's candidates drawn from its distribution
            return self._drawn(state, min(depth, max(1, nodes // self.draw)), self.draw)
        position = torch.full((1,), state.length, device=self.device)
        logits = yield shared.Ask(self, block=(state.root, position))  # [k, S]
        ids, scores = self._ranks(logits[: self.depth])
        if self.topk == 1:  # the chain: no host read, the engine's step sync reads the ids
            n = min(nodes, depth)
            self.ranked, self.scores = chain(n), []
            tree = _compiled(tuple(self.ranked)).to(self.device)
            return Proposal(tree=tree, tokens=torch.cat([state.root.view(1), ids[:n, 0].to(state.root.dtype)]),
                            is_chain=True)
        paths = block_paths(depth, self.topk)
        # the drafting's host reads: what was drafted and its scores, to select the tree
        id_list, score_list = ids[:depth].flatten().tolist(), scores[:depth].flatten().tolist()
        keep = select(paths, score_list, min(nodes, len(paths)))
        self.ranked, self.scores = [paths[i] for i in keep], [score_list[i] for i in keep]
        tree = _compiled(tuple(sorted(self.ranked, key=lambda p: (len(p), p)))).to(self.device)
        index = {p: i for i, p in enumerate(paths)}
        drafted = torch.tensor([id_list[index[p]] for p in tree.paths], device=self.device)
        return Proposal(tree=tree, tokens=torch.cat([state.root.view(1), drafted]),
                        is_chain=len(tree.leaves) == 1)

    def _drawn(self, state: DecodeState, depth: int, width: int) -> Proposal:
        """``width`` candidates drawn at each of the block's first ``depth`` positions from its
        processed distribution there (0: the root alone, plain decoding)."""
        if depth == 0:
            self.ranked, self.scores = [], []
            return Proposal(tree=_compiled(()).to(self.device), tokens=state.root.view(1), is_chain=True)
        position = torch.full((1,), state.length, device=self.device)
        logits = self._logits(state.root, position, depth).float()  # [depth, S]
        ids = self.heads.to_target(torch.arange(logits.shape[-1], device=self.device))  # [S] target ids
        levels = [draw(logits[d], state.sampling, width, state.generator, ids, self.heads.config.vocab_size)
                  for d in range(depth)]
        proposal = drawn_proposal(state.root, levels)
        self.ranked, self.scores = list(proposal.tree.paths), []
        return proposal

    @torch.inference_mode()
    def chain_laws(self, state: DecodeState, tokens: list[int]) -> list[torch.Tensor]:
        """The block's processed laws (``state.sampling`` applied, over the draft vocabulary) at
        its first len(tokens) positions, what :meth:`_drawn` draws from: one pass from the root, so
        the tokens give only the depth (for the drawn calibration: medusa/autotune/drawn.py)."""
        depth = min(len(tokens), self.k)
        if depth == 0:
            return []
        position = torch.full((1,), state.length, device=self.device)
        logits = self._logits(state.root, position, depth).float()
        return [probabilities(logits[d], state.sampling) for d in range(depth)]

    @torch.inference_mode()
    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        if self.max_rows == 1:
            return
        # the root and every accepted node are verified now: their features join the context
        nodes = torch.tensor(outcome.nodes, device=outcome.hidden.device)
        self.append(outcome.hidden[nodes], outcome.start)
