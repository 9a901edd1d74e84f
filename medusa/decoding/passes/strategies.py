"""How the engine's target passes run: one small interface, :class:`PassStrategy`, and its kinds.

The decode loop (medusa/decoding/engine.py) never asks "am I compiled?": it asks its strategy
for a new cache, a prefill and the verification of a proposal's rows. Padding to a few pass
sizes, masks, cache reservation and output copies are the strategy's business.

- :class:`EagerPasses` (``name="eager"``): transformers' forward on a dynamic cache.
- :class:`StaticPasses` (``"static"``): the same forward on a static cache (fixed shapes and addresses).
- :class:`SavedGraphPasses` (``"saved-graphs"``): on a CPU, each pass size compiled once and
  saved for later processes (medusa/decoding/passes/saved.py), on a static cache.
- :class:`TracedPasses` (``"cuda-graphs"`` on CUDA, else ``"traced"``): ``torch.compile`` traced
  in each process (CUDA graphs, "reduce-overhead", on CUDA), on a static cache.
- :class:`AutoPasses` (``"auto"``): per generation, the saved graphs where every size it needs
  is saved, else eager on a dynamic cache; nothing compiles in the process.

:func:`make_passes` builds one from the engine's ``compile``, ``static_cache``, ``kernels``
and ``exact``; the module surgery compiled passes need (opaque norms and rotary for exact
ones, inductor's kernel cache) happens there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from medusa.decoding.passes.saved import SavedPasses, example_pass
from medusa.decoding.state import Proposal
from medusa.errors import MedusaError
from medusa.models.target import context_window
from medusa.runtime import gemv, native, packed, rows
from medusa.runtime import hf as kv
from medusa.runtime.files import cache_root
from medusa.runtime.kernels import PackedLinears, onednn_available, split_kernels
from medusa.runtime.kvstore import KVStore
from medusa.runtime.opaque import opaque_ops
from medusa.runtime.screen import VocabScreen

AUTO = "auto"
# Compiled pass sizes: a proposal of n nodes runs padded to the smallest bucket >= n (at most
# 1.5x the rows), so one process compiles a handful of graphs whatever the proposals are.
PASS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PACKED_ROWS = 64  # half precision: passes of more rows (a prefill) use torch's linear kernels
SLOT_STEP = 64  # static cache growth of saved CPU graphs (SavedGraphPasses.slot_step)

Outputs = tuple[torch.Tensor, torch.Tensor]  # a prefill's: logits [1, V] (the last row), hidden states [T, H]
# a verification's: the candidates' logits [n, V] and hidden states [n, H], the side rows' logits [E, V] or None
Verified = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def pass_bucket(n: int) -> int:
    """The compiled pass size for ``n`` rows (``n`` itself past the largest bucket)."""
    return next((b for b in PASS_BUCKETS if b >= n), n)


def pad_pass(tokens: torch.Tensor, depth: torch.Tensor, ancestor: torch.Tensor, size: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a pass of ``n`` rows to ``size``: padding rows hold token 0 at the root's position and
    see the prefix and themselves only, so no real row sees them; their logits are dropped and
    their cache entries cut with the rejected nodes."""
    n = tokens.shape[0]
    if size == n:
        return tokens, depth, ancestor
    grown = torch.eye(size, dtype=torch.bool, device=ancestor.device)
    grown[:n, :n] = ancestor
    return (torch.cat([tokens, tokens.new_zeros(size - n)]), torch.cat([depth, depth.new_zeros(size - n)]), grown)


def kernel_scope(model: PreTrainedModel, kernels: str, draft: PreTrainedModel | None = None, heads=None):
    """The context in which the engine's passes run its linear kernels: ``"default"`` (torch's),
    ``"onednn"`` (packed oneDNN linears for the target, draft model and heads), ``"gemv"``
    (this package's kernels: float32 layers, and bfloat16 heads read at half the bytes), or a packed one above some rows
    with torch's below (``"gemv>3"``; medusa/runtime/kernels.py). Compiled passes trace inside it."""
    try:
        base, stock_rows = split_kernels(kernels)
    except ValueError as err:
        raise MedusaError(str(err)) from None
    if base == "default":
        return contextlib.nullcontext()
    device = model.get_output_embeddings().weight.device
    if base == "gemv":
        if device.type != "cpu" or model.dtype != torch.float32:
            raise MedusaError(f"kernels={kernels!r} runs float32 models on a CPU, not {model.dtype} on {device.type}: "
                              "use kernels='onednn' or 'default'")
        reason = gemv.unavailable_reason()
        if reason is not None:
            raise MedusaError(reason)
    elif not onednn_available(device, model.dtype):
        raise MedusaError(f"kernels={kernels!r} needs a CPU and torch build with oneDNN {model.dtype} linears, "
                          f"not {device.type} here: use kernels='default'")
    # Half precision: packed kernels only for decoding passes (at most PACKED_ROWS rows),
    # where they were measured bit-identical to torch's; a long prefill runs torch's own, so
    # the engine's prompt cache is stock transformers' (kernels.PackedLinears).
    half = model.dtype in (torch.bfloat16, torch.float16)
    packed_heads = None if getattr(heads, "int8", False) else heads  # int8 heads run their own kernel
    return PackedLinears(model, draft, packed_heads, stock_above=PACKED_ROWS if half else None, kernels=base,
                         stock_rows=stock_rows)


def _rows(proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pass's tokens, depths and ancestor mask: the candidates, then any side rows that none
    of them sees (:class:`~medusa.decoding.state.SideRows`)."""
    tokens, depth, ancestor = proposal.tokens, proposal.tree.depth, proposal.tree.ancestor
    return (tokens, depth, ancestor) if proposal.side is None else proposal.side.joined(tokens, depth, ancestor)


def _split(proposal: Proposal, logits: torch.Tensor, hidden: torch.Tensor) -> Verified:
    """A pass's outputs: the candidates' rows, the side rows' logits; padding rows are dropped."""
    n = proposal.tokens.shape[0]
    side = None if proposal.side is None else logits[n:n + proposal.side.tokens.shape[0]]
    return logits[:n], hidden[:n], side


class PassStrategy:
    """How a generation's target passes run. The base is eager on a dynamic cache.

    ``name`` says which kind; ``static`` whether its caches are static; ``compiled`` whether
    passes may run compiled; ``reason`` why this kind was built; ``saved`` the saved CPU graphs
    (:class:`~medusa.decoding.passes.saved.SavedPasses`) where there are any; ``forward`` the
    function a pass calls (:func:`medusa.runtime.hf.forward`'s signature: wrap it to watch passes).
    """

    name, static, compiled = "eager", False, False
    packs = True  # several sequences' rows can share one pass (verify_many)
    saved: SavedPasses | None = None
    features: tuple[int, ...] | None = None  # passes return these layers' inputs, not the final hidden state
    # the KV store the sequences' caches take slots of (medusa/runtime/kvstore.py; a scheduler sets it)
    store: KVStore | None = None
    # greedy rows' logits screened in bfloat16 (medusa/runtime/screen.py; the engine sets it where it applies)
    screen: VocabScreen | None = None

    def use_features(self, layers: tuple[int, ...] | None) -> None:
        """Return the residual stream entering ``layers`` as every pass's hidden states (EAGLE-3
        heads read several of the target's layers; :func:`medusa.runtime.hf.forward`)."""
        self.features = None if layers is None else tuple(int(i) for i in layers)

    def __init__(self, model: PreTrainedModel, reason: str = "compile=False", kernels: str = "default") -> None:
        self.model, self.reason, self.kernels = model, reason, kernels
        self.device = model.get_output_embeddings().weight.device
        self.max_positions = context_window(model)
        self.cache_arg = kv.cache_argument(model)  # resolved here, not inside a compiled pass
        self.forward: Callable = kv.forward
        # every verification row's attention in one call per layer (medusa/runtime/rows.py): eager float32 CPU
        self.one_call = not self.static and rows.supported(model) is None
        if self.one_call and native.supported(model) is None:  # whole passes in one C call (gemv kernels)
            self.forward = native.forward

    whole_calls = property(lambda self: self.forward is native.forward and self.kernels == "gemv",
                           doc="Whether its passes, prefill chunks included, run as one C call each (gemv kernels).")

    @property
    def runs(self) -> str:
        """How its decoding passes run, in words (``Engine.describe``)."""
        if self.whole_calls:
            return "each decoding pass one C call (medusa/runtime/native.py)"
        if self.one_call:
            return "the model's modules, attention in one call per layer"
        return "the model's modules"

    def for_generation(self, sizes: Callable[[], list[int]]) -> PassStrategy:
        """The strategy one generation runs on (``sizes()``: the pass sizes its proposer uses)."""
        return self

    def new_cache(self):
        """A sequence's cache: a slot of :attr:`store` where one is set and free, else its own buffers."""
        cache = None if self.store is None else self.store.cache()
        return kv.new_cache() if cache is None else cache

    def prefill(self, cache, ids: torch.Tensor, start: int, max_new_tokens: int) -> Outputs:
        """Run the prompt's tokens ``ids`` ``[1, T]`` from position ``start``; the last row's outputs. As a
        one-call pass where decoding passes are one (:func:`medusa.runtime.packed.prefill`), else the modules."""
        if self.whole_calls and (out := packed.prefill(self.model, cache, ids, start, self.features, self.forward)):
            return out
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        return kv.forward(self.model, ids, positions, cache, None, logits_rows=slice(-1, None), layers=self.features)

    def verify(self, cache, start: int, proposal: Proposal, min_rows: int = 1) -> Verified:
        """The target's outputs for ``proposal``'s ``n`` candidate rows after ``start`` cached
        tokens (``[n, V]``, ``[n, H]``) and its side rows' logits (``[E, V]``, None without side
        rows); their keys and values are left in ``cache`` after ``start``."""
        if self.one_call:  # the very call a packed pass makes: a row's bits do not depend on the batch
            return self._packed([(cache, start, proposal)])[0]
        tokens, depth, ancestor = _rows(proposal)
        # an explicit mask for chains too: a packed batch gives each sequence this same mask
        # (verify_many), so a sequence's attention is the same call alone and in a batch
        mask = kv.tree_attention_mask(self.model, start, ancestor, depth, self.model.dtype)
        logits, hidden = self.forward(self.model, tokens[None], (start + depth)[None], cache, mask,
                                      cache_arg=self.cache_arg, layers=self.features, **self._vocab([proposal]))
        return _split(proposal, logits, hidden)

    def _vocab(self, proposals: Sequence[Proposal]) -> dict:
        """A pass's ``vocab`` argument: the screen where every proposal in it reads only argmaxes."""
        return {"vocab": self.screen.logits} if self.screen is not None and all(p.argmax for p in proposals) else {}

    def verify_many(self, items: Sequence[tuple[object, int, Proposal]], prefill: packed.Chunk | None = None,
                    ) -> list[Verified | Outputs | None]:
        """:meth:`verify` of each ``(cache, start, proposal)`` in one packed pass (only where
        :attr:`packs`): each sequence's rows see its own cache, as alone (one attention call per
        layer for all rows where :attr:`one_call`, else per sequence with the mask it gets alone).
        ``prefill`` (where :attr:`whole_calls`): a prompt's next rows in the same pass, after the
        sequences', the bits :meth:`prefill` computes; its outputs come last: the logits ``[1, V]``
        of its last row (None before the prompt's last chunk) and its hidden states ``[n, H]``."""
        return self._packed(items, prefill)

    def _packed(self, items: Sequence[tuple[object, int, Proposal]], prefill: packed.Chunk | None = None,
                ) -> list[Verified | Outputs | None]:
        trees, tokens, positions = [], [], []
        for _, start, proposal in items:
            toks, depth, ancestor = _rows(proposal)
            trees.append((start, ancestor, depth))
            tokens.append(toks)
            positions.append(start + depth)
        vocab = self._vocab([p for _, _, p in items])
        if prefill is not None:  # a chain after the sequences' rows: logits for its last row only
            vocab = {"vocab": prefill.vocab(vocab.get("vocab"), sum(t.shape[0] for t in tokens))}
            trees.append(prefill.tree(self.model))
            tokens.append(prefill.ids)
            positions.append(prefill.start + trees[-1][2])
            items = [*items, (prefill.cache, prefill.start, None)]
        layout = None
        if self.one_call:
            try:
                layout = rows.layout_for(self.model, trees)
            except ValueError:  # a tree deeper than a sliding window: per sequence, masked
                layout = None
        if prefill is not None and layout is None:
            raise ValueError("a prompt's rows share a decoding pass only with the one-call attention")
        segments, at = [], 0
        for (cache, _, _), (start, ancestor, depth), toks in zip(items, trees, tokens):
            mask = None if layout is not None else kv.tree_attention_mask(self.model, start, ancestor, depth,
                                                                          self.model.dtype)
            segments.append(packed.Segment(cache, slice(at, at + toks.shape[0]), mask))
            at += toks.shape[0]
        logits, hidden = packed.forward(self.model, torch.cat(tokens)[None], torch.cat(positions)[None], segments,
                                        layers=self.features, layout=layout, through=self.forward,
                                        starts=[start for start, _, _ in trees], **vocab)
        out = [_split(p, logits[s.rows], hidden[s.rows]) for s, (_, _, p) in zip(segments, items) if p is not None]
        if prefill is not None:
            last = segments[-1].rows
            out.append((logits[last.start:] if prefill.last else None, hidden[last]))
        return out

    def warm(self, sizes: Sequence[int], progress: Callable[[int, float], None] | None = None) -> list[int]:
        """Compile (or load, where saved) the pass of each of ``sizes``; the sizes done."""
        return []

    def missing(self, sizes: Sequence[int]) -> list[int]:
        """The pass ``sizes`` not saved for this machine (only saved graphs save any)."""
        return []


class StaticPasses(PassStrategy):
    """Eager passes on a static cache. Its capacity grows in powers of two (``slot_step``
    None) or ``slot_step`` slots at a time; ``pads`` pads passes to their bucket (compiled
    kinds: a handful of graphs whatever the proposals are)."""

    name, static = "static", True
    packs = False  # static layers are written at their own cumulative length: one sequence a pass
    slot_step: int | None = None
    pads = False

    def new_cache(self):
        return kv.new_static_cache(self.model, 256)

    def prefill(self, cache, ids: torch.Tensor, start: int, max_new_tokens: int) -> Outputs:
        total = start + ids.shape[1]
        # room for the answer and a large tree, so that decoding rarely regrows the cache; a
        # saved CPU graph takes any capacity, so there the cache grows as it fills
        room = total + (SLOT_STEP if self.slot_step else max_new_tokens + 64)
        kv.reserve(cache, min(room, self.max_positions) if self.max_positions else room, self.slot_step)
        mask = kv.causal_mask(self.model, start, ids.shape[1], self.model.dtype, self.device, kv.capacity(cache))
        positions = torch.arange(start, total, device=self.device)[None]
        return kv.forward(self.model, ids, positions, cache, mask, logits_rows=slice(-1, None), layers=self.features)

    def verify(self, cache, start: int, proposal: Proposal, min_rows: int = 1) -> Verified:
        tokens, depth, ancestor = _rows(proposal)
        if self.pads:  # a pass of fewer rows than the proposer's usual reuses the usual graph
            tokens, depth, ancestor = pad_pass(tokens, depth, ancestor, pass_bucket(max(tokens.shape[0], min_rows)))
            if not tokens.is_inference():  # a proposer's own tensor: guards tell the two kinds apart
                tokens = tokens.clone()
        kv.reserve(cache, start + tokens.shape[0], self.slot_step)
        mask = kv.tree_attention_mask(self.model, start, ancestor, depth, self.model.dtype, kv.capacity(cache))
        self._before(cache, mask)
        logits, hidden = self.forward(self.model, tokens[None], (start + depth)[None], cache, mask,
                                      cache_arg=self.cache_arg, layers=self.features)
        return self._after(*_split(proposal, logits, hidden))  # padding rows are never verified

    def _before(self, cache, mask) -> None:
        pass

    def _after(self, logits: torch.Tensor, hidden: torch.Tensor, side: torch.Tensor | None) -> Verified:
        return logits, hidden, side


class SavedGraphPasses(StaticPasses):
    """On a CPU: each pass size compiled once and saved for later processes (``saved``). The
    capacity is symbolic in a saved graph, so the cache grows ``SLOT_STEP`` slots at a time,
    keeping the slots attention reads close to the length."""

    name, compiled, pads, slot_step = "saved-graphs", True, True, SLOT_STEP

    def __init__(self, model: PreTrainedModel, saved: SavedPasses, reason: str, kernels: str = "default") -> None:
        super().__init__(model, reason, kernels)
        self.saved = self.forward = saved

    @torch.inference_mode()
    def warm(self, sizes: Sequence[int], progress: Callable[[int, float], None] | None = None) -> list[int]:
        for b in sizes:
            t0 = time.perf_counter()
            # a saved size is loaded (or compiled and saved); build=False leaves a missing one eager
            if self.saved.graph(self.model, b, self.cache_arg) is None and self.saved.build:
                self.saved(*example_pass(self.model, b, self.cache_arg, self.features), cache_arg=self.cache_arg, layers=self.features)
            if progress is not None:
                progress(b, time.perf_counter() - t0)
        return list(sizes)

    def use_features(self, layers: tuple[int, ...] | None) -> None:
        super().use_features(layers)
        self.saved.layers = self.features  # graphs returning these layers are saved apart

    def missing(self, sizes: Sequence[int]) -> list[int]:
        return self.saved.missing(list(sizes))


class TracedPasses(StaticPasses):
    """``torch.compile`` traced in each process: CUDA graphs ("reduce-overhead") on CUDA. Each
    pass marks the cache's capacity dynamic (one graph per bucket, whatever the capacity) and
    its outputs are cloned (CUDA graphs reuse their output memory at the next replay). The
    capacity grows in powers of two: CUDA graphs record one graph per capacity."""

    compiled, pads = True, True

    def __init__(self, model: PreTrainedModel, compile: bool | str, reason: str, kernels: str = "default") -> None:
        super().__init__(model, reason, kernels)
        backend = compile if isinstance(compile, str) else "inductor"
        self.name = "cuda-graphs" if self.device.type == "cuda" and backend == "inductor" else "traced"
        self.forward = kv.compiled_forward(self.device, compile)

    @torch.inference_mode()
    def warm(self, sizes: Sequence[int], progress: Callable[[int, float], None] | None = None) -> list[int]:
        for b in sizes:
            t0 = time.perf_counter()
            self.forward(*example_pass(self.model, b, self.cache_arg, self.features), cache_arg=self.cache_arg, layers=self.features)
            if progress is not None:
                progress(b, time.perf_counter() - t0)
        return list(sizes)

    def _before(self, cache, mask) -> None:
        kv.mark_capacity_dynamic(cache, mask)

    def _after(self, logits: torch.Tensor, hidden: torch.Tensor, side: torch.Tensor | None) -> Verified:
        return logits.clone(), hidden.clone(), None if side is None else side.clone()


class AutoPasses(PassStrategy):
    """``compile="auto"`` on a CPU: a generation whose pass sizes are all saved here runs the
    saved graphs (``graphs``), any other eagerly on a dynamic cache (``eager``), and nothing
    compiles in the process. A missing size is looked for again every few seconds, so what a
    background build saves (:mod:`medusa.decoding.passes.build`) is picked up while it runs."""

    name, compiled = "auto", True

    def __init__(self, model: PreTrainedModel, graphs: SavedGraphPasses, reason: str, kernels: str = "default") -> None:
        super().__init__(model, reason, kernels)
        self.graphs, self.eager, self.saved = graphs, PassStrategy(model, reason, kernels), graphs.saved

    def use_features(self, layers: tuple[int, ...] | None) -> None:
        super().use_features(layers)
        self.graphs.use_features(layers)
        self.eager.use_features(layers)

    def for_generation(self, sizes: Callable[[], list[int]]) -> PassStrategy:
        try:
            return self.eager if self.graphs.missing(sizes()) else self.graphs
        except MedusaError:  # a proposer that does not say its sizes
            return self.eager

    def verify(self, cache, start: int, proposal: Proposal, min_rows: int = 1) -> Verified:
        # the generation's kind, told by its cache (a state prefilled before all sizes were saved)
        return (self.graphs if kv.is_static(cache) else self.eager).verify(cache, start, proposal, min_rows)

    def warm(self, sizes: Sequence[int], progress: Callable[[int, float], None] | None = None) -> list[int]:
        return self.graphs.warm(sizes, progress)

    def missing(self, sizes: Sequence[int]) -> list[int]:
        return self.graphs.missing(sizes)


def _auto(device: torch.device, model: PreTrainedModel, exact: bool) -> tuple[bool, str]:
    """``compile="auto"``: whether to compile, and why. On a CPU the passes run compiled where
    this machine has them saved and eagerly otherwise, never compiling in the process
    (docs/compile.md#compiled and docs/compile.md#compiled-exact-passes; compiling takes
    minutes, so a background build does it, :func:`medusa.decoding.passes.build.start_build`).
    Elsewhere eager: CUDA graphs compile in the process (docs/compile.md), which ``compile=True``
    asks for and auto does not do behind a user's back. Exact passes need opaque norms and
    rotary (the module surgery; a norm of another form refuses, and the passes stay eager)."""
    if device.type != "cpu":
        why = ("CUDA graphs ran 5x faster on an H200 but compile for ~45 s per pass size in the process: "
               "pass compile=True (--compile)") if device.type == "cuda" else "compiled passes are measured on CPUs and CUDA only"
        return False, f"compile=auto: eager on {device.type} ({why})"
    if exact:
        try:
            opaque_ops(model)
        except MedusaError as e:
            return False, f"compile=auto: eager ({e})"
    return True, "compile=auto: pass sizes saved for this machine run compiled, the others eagerly until saved"


def make_passes(model: PreTrainedModel, compile: bool | str = False, static_cache: bool = False,
                kernels: str = "default", exact: bool = False) -> PassStrategy:
    """The pass strategy for ``compile`` (see :class:`medusa.decoding.engine.Engine`): False:
    eager, on a static cache with ``static_cache``; True (or a torch.compile backend's name):
    saved graphs on a CPU, CUDA graphs on CUDA (traced by that backend elsewhere); ``"auto"``:
    :class:`AutoPasses` on a CPU, eager elsewhere. ``exact``: the model's attention is exact
    (:func:`use_exact`); compiled exact passes get opaque norms and rotary here."""
    device = model.get_output_embeddings().weight.device
    auto = compile == AUTO
    reason = f"compile={compile!r}"
    if auto:
        compile, reason = _auto(device, model, exact)
    if not compile:
        return (StaticPasses if static_cache else PassStrategy)(model, reason, kernels)
    if exact:
        opaque_ops(model)
    kv.persist_compiled(cache_root() / "inductor")
    if device.type != "cpu":
        return TracedPasses(model, compile, reason, kernels)
    backend = compile if isinstance(compile, str) else "inductor"
    graphs = SavedGraphPasses(model, SavedPasses(model, cache_root() / "compiled", backend, kernels, build=not auto),
                              reason, kernels)
    return AutoPasses(model, graphs, reason, kernels) if auto else graphs
