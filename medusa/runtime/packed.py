"""Several sequences in one target pass: packed rows, each sequence's keys in its own cache.

A batched step puts every sequence's new rows (its tree, chain or lone root) one after the other
in a single ``[1, R]`` input, so the linear layers - the weights every pass reads, most of a
step's cost on a CPU - run once for all of them. Each sequence keeps its own KV cache: during a
packed pass :class:`PackedCache` stands in for the model's cache, and ``update`` writes each
sequence's slice of the new keys and values into that sequence's cache. Attention then runs

- in one call per layer for every row (:mod:`medusa.runtime.rows`: float32 on a CPU), each row
  over its own sequence's keys in a fixed order; or
- per sequence (:func:`packed_attention`): the model's original implementation (SDPA, or the exact
  attention in half precision) on that sequence's query rows, its cache and the very mask a pass
  of that sequence alone would have been given, the rows concatenated.

Either way a sequence's attention is what it gets alone; the rows of the linear layers are the
same rows, so a step's outputs equal each sequence's own pass wherever the linear kernels give a
row the same bits whatever the row count (the gemv kernels in float32, bfloat16 ``F.linear`` on
AMX; docs/exactness.md#batches).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from medusa.runtime import clock, gemv, rows
from medusa.runtime import hf as kv

NAME = "medusa_packed"


@dataclass
class Segment:
    """One sequence's part of a packed pass: its ``cache``, its ``rows`` ``[start, stop)`` of the
    packed input, and ``mask``: the additive mask a pass of this sequence alone gets
    (:func:`medusa.runtime.hf.tree_attention_mask`: a tensor ``[1, 1, n, past + n]`` or one per
    layer type)."""

    cache: Cache
    rows: slice
    mask: torch.Tensor | dict[str, torch.Tensor]


def buffers(cache: Cache, layers: int, needed: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each layer's key and value buffers (``[1, H_kv, capacity, D]``), grown to hold ``needed``
    positions, for a writer that fills them in place and then calls :func:`extend`; None unless
    every one of the ``layers`` is an initialised :class:`~medusa.runtime.hf.BufferedLayer`."""
    if len(cache.layers) != layers or not all(isinstance(x, kv.BufferedLayer) and x.is_initialized and
                                              x._kbuf is not None for x in cache.layers):
        return None
    out = [(layer._kbuf, layer._vbuf) for layer in cache.layers]
    if all(k.shape[-2] >= needed for k, _ in out):  # room already: the usual step
        return out
    for layer in cache.layers:
        layer._reserve(layer.keys, layer.values, needed)
    return [(layer._kbuf, layer._vbuf) for layer in cache.layers]


def start_buffers(cache: Cache, model: PreTrainedModel, needed: int) -> bool:
    """Give every layer of an empty buffered cache (:func:`medusa.runtime.hf.new_cache`, or a KV
    store slot) its buffers, with room for ``needed`` positions, so that a one-call pass writes
    them from the first token; False (nothing done) for a cache that holds positions or is not
    buffered."""
    layers = kv.text_config(model).num_hidden_layers
    if cache.layers and (len(cache.layers) != layers or any(x.is_initialized for x in cache.layers)):
        return False
    if not cache.layers:
        if getattr(cache, "layer_class_to_replicate", None) is not kv.BufferedLayer:
            return False
        cache.layers = [kv.BufferedLayer() for _ in range(layers)]
    if not all(isinstance(x, kv.BufferedLayer) for x in cache.layers):
        return False
    _, heads, dim = rows.attention_shape(model)
    empty = torch.empty(1, heads, 0, dim, dtype=model.dtype, device=model.get_output_embeddings().weight.device)
    for layer in cache.layers:
        layer.lazy_initialization(empty, empty)
        layer._reserve(empty, empty, needed)
        layer.keys, layer.values = layer._kbuf[..., :0, :], layer._vbuf[..., :0, :]
    return True


def prefill(model: PreTrainedModel, cache: Cache, ids: torch.Tensor, start: int, layers: tuple[int, ...] | None,
            through: Callable) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A prompt's rows ``ids`` ``[1, n]`` after ``start`` cached positions as one chain in a
    one-call pass (``through``: :func:`medusa.runtime.native.forward`), each row computed as a
    decoding pass computes it, so the cache holds the same bits however the prompt was cut into
    passes or shared: ``(logits [1, V]`` of the last row, ``hidden [n, H])``. A fresh cache gets
    its buffers first. None (nothing run) where the model's window is shorter than the chain or
    the cache is not buffered."""
    n, device = ids.shape[1], ids.device
    depth = torch.arange(n, device=device)
    try:
        layout = rows.layout_for(model, [(start, torch.ones(n, n, dtype=torch.bool, device=device).tril_(), depth)])
    except ValueError:
        return None
    count = kv.text_config(model).num_hidden_layers
    if start == 0:
        start_buffers(cache, model, n)
    if buffers(cache, count, start + n) is None:
        return None
    return forward(model, ids, (start + depth)[None], [Segment(cache, slice(0, n), None)], layers=layers,
                   layout=layout, through=through, starts=[start], vocab=_last_row)


def _last_row(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """A prefill's logits: its last row's alone."""
    return kv.lm_logits(model, hidden[-1:]).float()


@dataclass
class Chunk:
    """A prompt's rows ``ids`` ``[n]`` after ``start`` positions of ``cache``, run as one chain
    after other sequences' rows in a decoding pass, each row as :func:`prefill` computes it;
    ``last``: they end the prompt (its last row's logits are wanted)."""

    cache: Cache
    start: int
    ids: torch.Tensor
    last: bool

    def tree(self, model: PreTrainedModel) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(start, ancestor, depth)`` of the chain, for :func:`medusa.runtime.rows.layout`; a
        fresh cache gets its buffers first, as :func:`prefill` gives them."""
        n, device = self.ids.shape[0], self.ids.device
        if self.start == 0:
            start_buffers(self.cache, model, n)
        return self.start, torch.ones(n, n, dtype=torch.bool, device=device).tril_(), torch.arange(n, device=device)

    def vocab(self, base: Callable | None, rows: int) -> Callable:
        """The pass's logits function: the first ``rows`` rows' by ``base`` (None: the lm_head's),
        then, where :attr:`last`, the chunk's last row's as :func:`prefill` computes it."""
        def logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
            parts = [(base or kv.lm_logits)(model, hidden[:rows]).float()] if rows else []
            if self.last:
                parts.append(_last_row(model, hidden))
            if not parts:
                return hidden.new_empty(0, model.get_output_embeddings().weight.shape[0])
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return logits


def extend(cache: Cache, length: int) -> None:
    """After writing into :func:`buffers`: the cache holds ``length`` positions."""
    for layer in cache.layers:  # the views (narrowed buffers) are made when something reads them
        layer.hold(length)


class PackedCache(Cache):
    """The cache a packed pass hands the model: each layer's ``update`` goes to the segments'
    own caches; ``current[layer]`` keeps what each returned (``[1, Hkv, L_i, D]``) for
    :func:`packed_attention`. With ``starts`` (each segment's cached length) and buffered caches
    (:func:`buffers`), a layer's rows are written with one C call for all
    segments and ``current`` holds the whole buffers (the one-call attention reads positions
    from its layout); :meth:`finish` then sets each cache's length."""

    def __init__(self, segments: list[Segment], layers: int, starts: list[int] | None = None) -> None:
        super().__init__(layers=[])
        self.segments, self.starts = segments, starts
        self.current: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * layers
        self.buffers = None
        if starts is not None and gemv.unavailable_reason() is None:
            found = [buffers(s.cache, layers, start + s.rows.stop - s.rows.start)
                     for s, start in zip(segments, starts)]
            if all(b is not None for b in found):
                self.buffers = found  # [segment][layer] -> (keys, values)
                self._row0 = (ctypes.c_int32 * len(segments))(*(s.rows.start for s in segments))
                self._rows = (ctypes.c_int32 * len(segments))(*(s.rows.stop - s.rows.start for s in segments))
                self._start = (ctypes.c_int32 * len(segments))(*starts)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffers is None:
            # key_states [1, Hkv, R, D]: row slices are views; each cache copies them into its buffer
            self.current[layer_idx] = [s.cache.update(key_states[..., s.rows, :], value_states[..., s.rows, :],
                                                      layer_idx) for s in self.segments]
            return key_states, value_states  # unread: the attention reads ``current``
        pairs = [b[layer_idx] for b in self.buffers]
        n = len(pairs)
        k, v = key_states, value_states  # float32: the one-call path runs float32 passes only
        if k.stride() != v.stride() or k.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        dst = (ctypes.c_int64 * (4 * n))(*(b.data_ptr() for b, _ in pairs), *(c.data_ptr() for _, c in pairs),
                                         *(b.stride(1) for b, _ in pairs), *(b.stride(2) for b, _ in pairs))
        at = ctypes.addressof(dst)
        gemv.library().medusa_write_rows(k.data_ptr(), v.data_ptr(), k.stride(1), k.stride(2), k.shape[1], k.shape[3],
                                         n, self._row0, self._rows, self._start, at, at + 8 * n, at + 16 * n,
                                         at + 24 * n)
        self.current[layer_idx] = pairs
        return key_states, value_states

    def finish(self) -> None:
        """After a pass written through the buffers: each cache holds its new rows."""
        if self.buffers is not None:
            for s, start in zip(self.segments, self.starts):
                extend(s.cache, start + s.rows.stop - s.rows.start)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


class _Active(threading.local):
    pack: PackedCache | None = None
    original: str = "sdpa"
    layer_types: list[str] | None = None


_active = _Active()


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over a packed pass: query ``[1, H, R, D]``; returns
    ``[1, R, H, D]``: each segment's rows from the original implementation on its own cache."""
    pack, layer = _active.pack, module.layer_idx
    function = ALL_ATTENTION_FUNCTIONS[_active.original]
    kind = None if _active.layer_types is None else _active.layer_types[layer]
    outs = []
    for segment, (k, v) in zip(pack.segments, pack.current[layer]):
        mask = segment.mask[kind] if isinstance(segment.mask, dict) else segment.mask
        out, _ = clock.charged("attention", function, module, query[:, :, segment.rows], k, v, mask, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # never used: packed passes hand over prepared masks


def forward(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: list[Segment],
            layers: tuple[int, ...] | None = None, layout: rows.Layout | None = None,
            through: Callable = kv.forward, starts: list[int] | None = None,
            vocab: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the packed rows ``input_ids`` ``[1, R]`` (``position_ids`` ``[1, R]``: each
    row's position in its own sequence); each segment's keys and values are appended to its own
    cache. With ``layout`` (:func:`medusa.runtime.rows.layout`), every layer's attention is one
    call over all rows (:mod:`medusa.runtime.rows`) and the segments need no masks; without, it
    runs per segment with each one's mask. ``starts``: each segment's cached length (with ``layout``: the rows are
    then written into the caches' buffers in one call per layer). ``through``: the pass function called (a
    :class:`~medusa.decoding.passes.strategies.PassStrategy`'s ``forward`` hook); ``vocab``: its
    logits' function where not the lm_head's (:func:`medusa.runtime.hf.forward`). Returns ``(logits [R, V], hidden [R, H])`` like
    :func:`medusa.runtime.hf.forward`."""
    config = kv.text_config(model)
    configs = {id(c): c for c in (model.config, config)}.values()
    pack = PackedCache(segments, config.num_hidden_layers, starts if layout is not None else None)
    types = getattr(config, "layer_types", None)
    dummy = torch.zeros(1, 1, input_ids.shape[1], input_ids.shape[1], dtype=model.dtype, device=input_ids.device)
    mask = {k: dummy for k in set(types)} if types is not None and getattr(config, "sliding_window", None) else dummy
    saved = [c._attn_implementation_internal for c in configs]
    name = NAME if layout is None else rows.NAME
    _active.pack, _active.original, _active.layer_types = pack, config._attn_implementation, types
    rows._active.layout, rows._active.current, rows._active.types = layout, pack.current, types
    for c in configs:
        c._attn_implementation_internal = name
    try:
        out = through(model, input_ids, position_ids, pack, mask, layers=layers,
                      **({} if vocab is None else {"vocab": vocab}))
        pack.finish()
        return out
    finally:
        for c, was in zip(configs, saved):
            c._attn_implementation_internal = was
        _active.pack = None
        rows._active.layout = rows._active.current = None
