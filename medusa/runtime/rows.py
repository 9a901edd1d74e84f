"""Every row of a verification pass in one attention call per layer, whatever the sequences.

Why: a decoding pass's attention is small arithmetic in many small calls. Run per sequence
(:mod:`medusa.runtime.packed`'s fallback), a pass of eight sequences makes 8 x 30 calls of
torch's attention with their masks, each with its own fixed cost; a tree's rows each read the
whole prefix through a masked kernel. Here one C call per layer (``attention.c``, built with the
gemv kernels) takes every row of the pass: each row names its sequence's cached keys, the
contiguous run it sees (the prefix, and the leading part of its tree path) and its other tree
ancestors; rows of one sequence share each key and value load.

Exactness: a row's result is computed from its own key list in one fixed order (attention.c
spells it out), so it is bitwise the same alone, in a tree, or beside any other sequences; with
row-invariant linear kernels (gemv in float32) a packed pass gives each sequence the bits it gets
alone, guaranteed rather than measured (docs/exactness.md#batches).

Used for eager float32 passes on a CPU where the kernels build (:func:`supported`), prompts'
prefill chunks included where the whole pass is one C call (medusa/runtime/packed.py's ``prefill``).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel

from medusa.runtime import clock, gemv
from medusa.runtime import hf as kv

NAME = "medusa_rows"


@dataclass
class Layout:
    """Which keys each row of a pass attends to. Row ``r`` belongs to segment ``seg[r]``; it sees
    that segment's cache positions ``lo[r] .. hi[r]-1`` and ``extra[start[r]:start[r+1]]``
    (ascending). ``lo`` is one tensor, or one per layer type (sliding-window layers see less)."""

    seg: torch.Tensor  # [R] int32
    lo: torch.Tensor | dict[str, torch.Tensor]  # [R] int32
    hi: torch.Tensor  # [R] int32
    start: torch.Tensor  # [R + 1] int32
    extra: torch.Tensor  # [X] int32


def layout(items: list[tuple[int, torch.Tensor, torch.Tensor]], window: int | None = None,
           types: list[str] | None = None) -> Layout:
    """The layout of a pass over segments ``(past, ancestor [n, n] bool, depth [n])``, in order:
    segment ``i``'s rows see its ``past`` cached positions and their tree ancestors (appended at
    ``past + j``), as :func:`medusa.runtime.hf.tree_attention_mask` masks them."""
    segs, los, his, counts, extras = [], [], [], [], []
    for i, (past, ancestor, depth) in enumerate(items):
        n = ancestor.shape[0]
        if window is not None and n and int(depth.max()) >= window:
            raise ValueError(f"a tree {int(depth.max()) + 1} deep does not fit a sliding window of {window}")
        seen = ancestor.cpu()
        lead = seen.to(torch.int32).cumprod(1).sum(1)  # [n] the run of visible nodes from the root
        rest = seen & (torch.arange(n)[None, :] >= lead[:, None])  # [n, n] the ancestors past that run
        segs.append(torch.full((n,), i, dtype=torch.int32))
        his.append(past + lead)
        counts.append(rest.sum(1))
        extras.append(past + rest.nonzero()[:, 1])  # row-major: each row's extras ascending
        los.append(torch.clamp(past + depth.cpu() - window + 1, min=0) if window is not None else None)
    start = torch.zeros(sum(c.numel() for c in counts) + 1, dtype=torch.int32)
    torch.cumsum(torch.cat(counts), 0, out=start[1:])
    seg = torch.cat(segs)
    zero = torch.zeros_like(seg)
    lo: torch.Tensor | dict[str, torch.Tensor] = zero
    if window is not None:
        sliding = torch.cat(los).to(torch.int32)
        lo = sliding if types is None else {t: sliding if t == "sliding_attention" else zero for t in set(types)}
    return Layout(seg, lo, torch.cat(his).to(torch.int32), start, torch.cat(extras).to(torch.int32))


def layout_for(model: PreTrainedModel, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> Layout:
    """:func:`layout` with ``model``'s sliding window and layer types."""
    config = kv.text_config(model)
    return layout(items, getattr(config, "sliding_window", None), getattr(config, "layer_types", None))


def attention_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """``model``'s query heads, KV heads and head size."""
    config = kv.text_config(model)
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, (getattr(config, "head_dim", None)
                                                                           or config.hidden_size // heads)


def supported(model: PreTrainedModel) -> str | None:
    """None where this module runs ``model``'s passes, else why not (one line)."""
    config = kv.text_config(model)
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu" or model.dtype != torch.float32:
        return f"{model.dtype} on {weight.device.type}: one-call attention is for float32 on a CPU"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "attention_chunk_size", None):
        return "the model softcaps or chunks its attention scores"
    if any("sinks" in name for name, _ in model.named_parameters()):
        return "the model's attention has sink logits"
    reason = gemv.unavailable_reason()
    if reason is not None:
        return reason
    return supported_shape(*attention_shape(model))


def supported_shape(heads: int, kv_heads: int, dim: int) -> str | None:
    """None where the kernel takes ``heads`` query heads over ``kv_heads`` of size ``dim``, else why not."""
    lib = gemv.library()
    if dim % lib.medusa_attention_lanes() or dim > lib.medusa_attention_max_dim() or heads % kv_heads or heads // kv_heads > 64:
        return f"head size {dim} with {heads} heads over {kv_heads} KV heads: not a shape the kernel takes"
    return None


class _Active(threading.local):
    layout: Layout | None = None
    current: list | None = None  # per layer: each segment's (keys, values) after the pass's update
    types: list[str] | None = None


_active = _Active()


def rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[1, H, R, D]`` over every row of the pass;
    returns ``[1, R, H, D]``. Keys and values are read where each segment's cache holds them."""
    plan, layer = _active.layout, module.layer_idx
    if query.dtype != torch.float32 or query.stride(-1) != 1:
        raise ValueError(f"one-call attention takes float32 queries with contiguous heads, not {query.dtype}")
    pairs = _active.current[layer]
    n = len(pairs)
    lo = plan.lo if not isinstance(plan.lo, dict) else plan.lo[_active.types[layer]]
    keys = (ctypes.c_int64 * n)(*(k.data_ptr() for k, _ in pairs))
    values = (ctypes.c_int64 * n)(*(v.data_ptr() for _, v in pairs))
    strides = (ctypes.c_int64 * (2 * n))(*(k.stride(1) for k, _ in pairs), *(k.stride(2) for k, _ in pairs))
    _, heads, rows, dim = query.shape
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    scale = scaling if scaling is not None else dim ** -0.5
    done = clock.charged("attention", gemv.library().medusa_rows_attention,
        query.data_ptr(), query.stride(1), query.stride(2), rows, heads, key.shape[1], dim, scale,
        ctypes.addressof(keys), ctypes.addressof(values), ctypes.addressof(strides),
        ctypes.addressof(strides) + 8 * n, plan.seg.data_ptr(), lo.data_ptr(), plan.hi.data_ptr(),
        plan.start.data_ptr(), plan.extra.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if done != 0:
        raise ValueError(f"one-call attention does not take head size {dim} with {heads} heads")
    return out[None], None


AttentionInterface.register(NAME, rows_attention)
