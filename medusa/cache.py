"""Every touch of Hugging Face internals lives here: the KV cache and attention masks.

The engine runs the stock transformers model. Tree attention needs three things that
transformers already accepts: explicit ``position_ids``, a prepared 4D additive
``attention_mask`` of shape ``[1, 1, n_new, past + n_new]`` (returned as-is by
transformers' mask preprocessing), and a ``DynamicCache`` whose tensors we compact after
verification so that only the accepted path stays.

The cache's layers are ``BufferedLayer``: a ``DynamicLayer`` whose keys and values live in
a preallocated buffer that grows by doubling. ``DynamicLayer`` concatenates, copying the
whole cache of every layer at every step; here a step writes only its new entries, and
cropping or compacting never reallocates.

``new_static_cache`` is the other kind, for ``torch.compile`` and CUDA graphs: transformers'
``StaticLayer`` per layer, a fixed ``[1, H_kv, capacity, D]`` tensor at a fixed address that
every pass writes in place at the layer's ``cumulative_length``. Attention then always reads
all ``capacity`` slots, so every mask is ``[1, 1, n_new, capacity]`` with the unused slots
masked; cropping moves ``cumulative_length`` back and compaction gathers in place, so the
tensors (and a captured graph's addresses) never change.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer


class BufferedLayer(DynamicLayer):
    """A full-length cache layer backed by a reusable buffer.

    ``keys``/``values`` are always views ``buffer[..., :length, :]``, so everything that
    reads a ``DynamicLayer`` (transformers' masks, ``get_seq_length``, our ``crop`` and
    ``keep_nodes``) works unchanged. ``update`` writes the new entries in place after
    ``length``, doubling the buffer when it is full: amortised O(new tokens) per step.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        kbuf = self._kbuf
        if kbuf is not None and kbuf.shape[-2] >= needed and kbuf.shape[:-2] == key_states.shape[:-2]:
            return
        capacity = max(needed, 2 * (kbuf.shape[-2] if kbuf is not None else 0), 256)
        length = self.get_seq_length()
        new_k = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        new_v = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if length:
            new_k[..., :length, :] = self.keys
            new_v[..., :length, :] = self.values
        self._kbuf, self._vbuf = new_k, new_v
        self.keys, self.values = new_k[..., :length, :], new_v[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        self._reserve(key_states, value_states, end)
        self._kbuf[..., start:end, :] = key_states
        self._vbuf[..., start:end, :] = value_states
        self.keys = self._kbuf[..., :end, :]
        self.values = self._vbuf[..., :end, :]
        return self.keys, self.values


def new_cache() -> DynamicCache:
    # Built without the model config on purpose: every layer is then a plain full-length
    # layer we can compact and crop freely; sliding windows are applied by the masks.
    cache = DynamicCache()
    cache.layer_class_to_replicate = BufferedLayer
    return cache


def new_static_cache(model: PreTrainedModel, capacity: int) -> Cache:
    """A cache of ``capacity`` slots per layer at fixed addresses (see the module docstring)."""
    layers = model.config.get_text_config().num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(layers)])


def is_static(cache: Cache) -> bool:
    return bool(cache.layers) and isinstance(cache.layers[0], StaticLayer)


def capacity(cache: Cache) -> int | None:
    """Slots of a static cache (``None``: a dynamic cache, which grows)."""
    return cache.layers[0].max_cache_len if is_static(cache) else None


def reserve(cache: Cache, needed: int) -> None:
    """Make a static cache hold at least ``needed`` positions: a larger one (a power of two)
    replaces each layer's tensors, keeping the cached entries. Dynamic caches grow alone."""
    if not is_static(cache) or cache.layers[0].max_cache_len >= needed:
        return
    size = 1 << (max(needed, 256) - 1).bit_length()
    with torch.inference_mode():
        _regrow(cache, size)


def _regrow(cache: Cache, size: int) -> None:
    for i, old in enumerate(cache.layers):
        new = StaticLayer(max_cache_len=size)
        if old.is_initialized:
            length = int(old.cumulative_length)
            new.lazy_initialization(old.keys, old.values)
            new.keys[..., :length, :] = old.keys[..., :length, :]
            new.values[..., :length, :] = old.values[..., :length, :]
            new.cumulative_length.fill_(length)
        cache.layers[i] = new


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


def _layers(cache: Cache):
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", False) and layer.keys is not None]


def crop(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions (a view: no copy; a static cache just forgets
    the slots after ``length``, which later passes overwrite and masks hide)."""
    for layer in _layers(cache):
        if isinstance(layer, StaticLayer):
            with torch.inference_mode():  # the counter may be an inference tensor
                layer.cumulative_length.fill_(length)
        else:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def keep_nodes(cache: Cache, start: int, nodes: torch.Tensor, contiguous: bool) -> None:
    """After a tree pass appended ``N`` entries at ``start``, keep only ``nodes`` of them.

    ``nodes`` are increasing indices into the tree (root first). When they are ``0..m-1``
    (always true for chains) this is a crop; otherwise the accepted entries are gathered
    into place, touching only the tree's slice of the cache.
    """
    m = nodes.numel()
    if not contiguous:
        idx = nodes + start
        for layer in _layers(cache):
            # [B, H_kv, N, D]: the gather copies first, so overlapping writes are safe
            layer.keys[..., start:start + m, :] = layer.keys.index_select(-2, idx)
            layer.values[..., start:start + m, :] = layer.values.index_select(-2, idx)
    crop(cache, start + m)


def _sliding_window(model: PreTrainedModel) -> int | None:
    return getattr(model.config, "sliding_window", None)


def _layer_types(model: PreTrainedModel) -> list[str] | None:
    return getattr(model.config, "layer_types", None)


def tree_attention_mask(
    model: PreTrainedModel,
    past: int,
    ancestor: torch.Tensor,
    depth: torch.Tensor,
    dtype: torch.dtype,
    kv_len: int | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask for ``N`` tree nodes appended after ``past`` cached positions.

    ``ancestor`` ``[N, N]`` bool says which tree nodes each node sees; ``depth`` ``[N]``
    gives positions ``past + depth``. Returns ``[1, 1, N, past + N]`` (0 = attend,
    dtype-min = masked), or a dict per layer type for models that mix sliding-window and
    full layers. ``kv_len`` (a static cache's capacity) widens it to ``[1, 1, N, kv_len]``
    with the slots after the tree masked.
    """
    n = ancestor.shape[0]
    device = ancestor.device
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), ancestor], dim=1)  # [N, past+N]
    window = _sliding_window(model)
    types = _layer_types(model)
    pad = 0 if kv_len is None else kv_len - past - n
    if pad < 0:
        raise ValueError(f"kv_len {kv_len} is shorter than the {past + n} positions the mask covers")

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        if pad:
            allowed = torch.cat([allowed, allowed.new_zeros(n, pad)], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    if not window:
        return additive(visible)
    q_pos = past + depth  # [N]
    k_pos = torch.cat([torch.arange(past, device=device), past + depth])  # [past+N]
    in_window = (q_pos[:, None] - k_pos[None, :]) < window  # transformers' sliding rule
    if types is None:
        # e.g. Mistral: one window for every layer
        return additive(visible & in_window)
    out: dict[str, torch.Tensor] = {}
    for kind in set(types):
        out[kind] = additive(visible & in_window) if kind == "sliding_attention" else additive(visible)
    return out


def causal_mask(model: PreTrainedModel, past: int, n: int, dtype: torch.dtype, device: torch.device,
                kv_len: int | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """:func:`tree_attention_mask` for a chain of ``n`` tokens (a prompt, a drafted run)."""
    ancestor = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    return tree_attention_mask(model, past, ancestor, torch.arange(n, device=device), dtype, kv_len)


def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None,
    logits_rows: torch.Tensor | slice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target pass over ``[1, n]`` new tokens; appends them to ``cache``.

    Returns ``(logits [r, V], hidden [n, H])`` where ``hidden`` is the final (normed)
    hidden state the ``lm_head`` reads and ``logits`` covers only ``logits_rows`` (all rows
    by default): projecting every prompt position to the vocabulary would be wasted work.
    ``attention_mask=None`` means plain causal attention (transformers builds it).
    """
    base = model.get_decoder()
    out = base(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
               attention_mask=attention_mask, use_cache=True)
    hidden = out.last_hidden_state[0]  # [n, H]
    rows = hidden if logits_rows is None else hidden[logits_rows]
    logits = model.get_output_embeddings()(rows)  # [r, V]
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float(), hidden


def compiled_forward(device: torch.device, compile: bool | str = True):
    """:func:`forward` through ``torch.compile`` (``compile``: True for inductor, with CUDA
    graphs on CUDA, or another backend's name), for static caches. Shapes are static: each
    new-token count compiles once. On CUDA the outputs live in the graph's memory until its
    next replay, so callers that keep them clone them."""
    backend = compile if isinstance(compile, str) else "inductor"
    mode = "reduce-overhead" if backend == "inductor" and torch.device(device).type == "cuda" else None
    return torch.compile(forward, backend=backend, mode=mode, dynamic=False)

