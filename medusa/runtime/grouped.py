"""Grouped-query SDPA for passes of several rows: the KV cache read in place, never copied per head.

Why: transformers' ``"sdpa"`` attention, given a mask and more than one query row (every tree,
chain and prefill chunk the engine verifies), repeats each KV head's keys and values for the
query heads that share it (``repeat_kv``) before calling SDPA: a copy of the whole cache, per
layer, per pass, which grows with the context while the rows' own work does not
(measured: docs/performance.md#a-pass-at-long-context).

How: the ``g`` query heads of a KV head become ``g x n`` query rows of one SDPA call on that KV
head (what transformers already does for a one-row pass), with the mask repeated for them; the
repeated mask is built once per pass and mask (the layers share it), not once per layer. Each
query row is computed by the same kernel from the same keys as before, and its output lands
where ``"sdpa"`` puts it. One-row passes, passes without a mask, per-head masks and compiled
graphs run transformers' own function unchanged.

Registered with transformers' ``AttentionInterface`` as ``"medusa_sdpa"``: the engine's
non-exact attention (medusa/runtime/exact.py :func:`set_exact`).
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "medusa_sdpa"
_KEPT = 4  # repeated masks kept per thread: a pass's one or two (sliding and full layers)
_local = threading.local()


def _grouped_mask(mask: torch.Tensor, groups: int, layer: int | None) -> torch.Tensor:
    """``mask`` ``[B, 1, n, L]`` repeated for ``groups`` query heads: ``[B, 1, groups * n, L]``,
    built once per pass for each mask (``layer``: the calling layer's index; a pass runs its
    layers in increasing order, so one not above the last starts a new pass)."""
    b, _, n, length = mask.shape
    if layer is None:
        return mask[:, :, None].expand(b, 1, groups, n, length).reshape(b, 1, groups * n, length)
    kept = getattr(_local, "masks", None)
    if kept is None or layer <= _local.layer:
        kept = _local.masks = []
    _local.layer = layer
    for ref, g, grouped in kept:
        if ref() is mask and g == groups:
            return grouped
    grouped = mask[:, :, None].expand(b, 1, groups, n, length).reshape(b, 1, groups * n, length)
    kept.insert(0, (weakref.ref(mask), groups, grouped))
    del kept[_KEPT:]
    return grouped


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (``[B, n, H, D]`` out), with the query heads of a KV head
    as rows of one call where it would repeat the cache for them."""
    b, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if (groups == 1 or n == 1 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or attention_mask.shape[2] != n or dropout
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or torch.compiler.is_compiling()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    rows = query.reshape(b, kv_heads, groups * n, dim)  # query head h = kv head h // groups
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=_grouped_mask(attention_mask, groups, getattr(module, "layer_idx", None)),
                                                           scale=scaling)
    return out.view(b, heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks "sdpa" builds
