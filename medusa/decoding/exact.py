"""Batch-invariant attention: a token's row in a tree pass is bit-identical to its one-token pass.

Why: greedy speculation promises the tokens plain decoding would give. A tree pass computes
each node's row next to other rows, and a kernel whose blocking or reduction order depends on
the number of query rows (or on where the masked keys sit) rounds differently; in bfloat16 a
near-tie of the top two logits then flips and the output changes (see README "Exactness in
bfloat16" for the per-op evidence: here only attention breaks invariance in bfloat16; in
float32 the linear layers do too).

How: every query row attends to a *compacted* list of the keys it may see, in cache order
(the prefix, then its ancestors), exactly the list a one-token pass of that token sees, with
masked slots moved to the end. Each row is its own batch element of one batched matmul
(``M`` = the query heads sharing a KV head), so the result of a row depends neither on the
other rows nor on masked slots between its keys. The prompt, a tree and a one-token step all
run through this one function, so they use the same kernels.

It is registered with transformers' ``AttentionInterface`` as ``"medusa_exact"`` (masks built
by transformers' eager mask function), so the stock model runs it: no forked model code.
Cost: a gather of ``n x visible keys`` per layer and matmuls with few rows; see the README.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "medusa_exact"
_ROW_CHUNK = 64  # query rows per gather: bounds the [n, L, D] gathered keys of a long prompt


def _visible(mask: torch.Tensor | None, n: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(allowed [B, n, L] bool, bias [B, n, L])`` from an additive or boolean mask (or causal)."""
    if mask is None:
        # plain causal: the n queries are the last n positions
        allowed = torch.ones(n, length, dtype=torch.bool, device=device).tril_(length - n)[None]
        return allowed, torch.zeros(allowed.shape, device=device)
    if mask.shape[1] != 1:
        raise ValueError(f"medusa_exact expects a mask shared by all heads, got shape {tuple(mask.shape)}")
    mask = mask[:, 0, :, :length]  # [B, n, L]
    if mask.dtype == torch.bool:
        return mask, torch.zeros(mask.shape, device=device)
    return mask > torch.finfo(mask.dtype).min / 2, mask


def _rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, bias: torch.Tensor,
          scaling: float, softcap: float | None) -> torch.Tensor:
    """Attention for ``n`` query rows: query ``[B, Hkv, n, g, D]``, key/value ``[B, Hkv, L, D]``,
    ``allowed``/``bias`` ``[B, n, L]``. Returns ``[B, Hkv, n, g, D]``."""
    count = allowed.sum(-1)  # [B, n] keys each row sees
    width = int(count.max())
    if query.shape[2] == 1 and bool(allowed[..., :width].all()):
        # one row seeing the first `width` slots (a one-token step): the gather below would
        # copy them unchanged, so read them in place; the arithmetic is the same
        order = torch.arange(width, device=allowed.device).expand(*allowed.shape[:-1], width)  # [B, 1, W]
        keys, values = key[:, :, None, :width], value[:, :, None, :width]  # [B, Hkv, 1, W, D]
    else:
        # visible slots first, in cache order (a stable sort of "is masked"), then the masked ones
        order = torch.argsort((~allowed).to(torch.uint8), dim=-1, stable=True)[..., :width]  # [B, n, W]
        keys = torch.stack([key[b][:, order[b]] for b in range(key.shape[0])])  # [B, Hkv, n, W, D]
        values = torch.stack([value[b][:, order[b]] for b in range(value.shape[0])])  # [B, Hkv, n, W, D]
    valid = torch.arange(width, device=order.device) < count[..., None]  # [B, n, W]
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scaling  # [B, Hkv, n, g, W]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    extra = torch.gather(bias, -1, order).masked_fill(~valid, float("-inf"))  # [B, n, W]
    scores = scores + extra[:, None, :, None, :].to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, values)  # [B, Hkv, n, g, D]


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query ``[B, H, n, D]``, key/value ``[B, Hkv, L, D]``,
    mask ``[B, 1, n, L]``; returns ``([B, n, H, D], None)``. Inference only (no dropout)."""
    b, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = dim ** -0.5 if scaling is None else scaling
    allowed, bias = _visible(attention_mask, n, length, query.device)
    # the g query heads that share a KV head become the M rows of one small matmul per query row
    q = query.view(b, kv_heads, groups, n, dim).transpose(2, 3)  # [B, Hkv, n, g, D]
    out = torch.empty_like(q)
    for s in range(0, n, _ROW_CHUNK):
        e = min(n, s + _ROW_CHUNK)
        out[:, :, s:e] = _rows(q[:, :, s:e], key, value, allowed[:, s:e], bias[:, s:e], scaling, softcap)
    return out.transpose(2, 3).reshape(b, heads, n, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, exact_attention)
AttentionMaskInterface.register(NAME, eager_mask)  # additive masks, always materialised


def set_exact(model: PreTrainedModel, exact: bool) -> None:
    """Run ``model``'s attention batch-invariantly (``exact=True``) or with SDPA (False)."""
    model.set_attn_implementation(NAME if exact else "sdpa")


def is_exact(model: PreTrainedModel) -> bool:
    return model.config._attn_implementation == NAME
