"""A drafter layer in one C call (``decoder.c``'s ``medusa_draft_layer``), on the heads' own weights:
EAGLE-3 heads' layer, and EAGLE heads' (a stock Llama-style decoder layer after their ``fc``).

Why: drafting runs the heads' one decoder layer on a handful of rows several times a step (each
level of the draft tree, and the update with what the target accepted), and through the modules
each call spends longer on the layer's small operations and the calls around them than on its
products (docs/performance.md#a-drafter-layer-in-one-call). Here the layer's norms, products (the packed
copies a live :class:`~medusa.runtime.kernels.PackedLinears` holds, bfloat16 or float32, on the
gemv kernels), rotary embedding, cache writes, attention (:mod:`medusa.runtime.rows`'s kernel,
each row over the pairs it sees) and MLP run in one call, in float32. EAGLE heads' ``fc`` and final
norm stay modules around it (one product, one norm).

The heads' cache is a :class:`DraftCache` (float32 key/value buffers); masks become the attention
kernel's layout (:func:`layout_of`). Drafts only propose: the target verifies every token, so the
float32 arithmetic here (against the modules' bfloat16) changes which drafts are tried, never the
output (tests/test_drafter.py checks both paths agree to bfloat16 rounding).

Where: :class:`~medusa.models.eagle3_heads.Eagle3Heads` and :class:`~medusa.models.eagle_heads.EagleHeads`
(a Llama-style layer) on a CPU whose heads' linear layers run on the gemv kernels
(``kernels="gemv"``, entered), with unscaled rotary and no biases (:func:`table` returns None
otherwise and the proposer keeps the modules).
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import nn

from medusa.runtime import gemv, rows
from medusa.runtime import hf as kv
from medusa.runtime.kernels import packed_copy
from medusa.runtime.native import held_table


class DraftCache:
    """The heads' keys and values: float32 buffers ``[kv_heads, capacity, D]`` (grown by
    doubling), the first ``length`` positions in use."""

    def __init__(self, kv_heads: int, dim: int) -> None:
        self.keys = torch.empty(kv_heads, 256, dim)
        self.values = torch.empty(kv_heads, 256, dim)
        self.length = 0

    def reserve(self, length: int) -> None:
        capacity = self.keys.shape[1]
        if length <= capacity:
            return
        capacity = max(length, 2 * capacity)
        keys, values = self.keys.new_empty(self.keys.shape[0], capacity, self.keys.shape[2]), self.values.new_empty(
            self.values.shape[0], capacity, self.values.shape[2])
        keys[:, :self.length] = self.keys[:, :self.length]
        values[:, :self.length] = self.values[:, :self.length]
        self.keys, self.values = keys, values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        self.length = min(self.length, length)

    def module_cache(self, dtype: torch.dtype):
        """The same pairs in a dynamic cache of ``dtype`` (for the heads' modules)."""
        cache = kv.new_cache()
        if self.length:
            cache.update(self.keys[None, :, :self.length].to(dtype), self.values[None, :, :self.length].to(dtype), 0)
        return cache

    def drop_front(self, n: int) -> None:
        """Forget the first ``n`` positions (the kept ones move to the front, rotary phases kept)."""
        kept = self.length - n
        self.keys[:, :kept] = self.keys[:, n:self.length].clone()
        self.values[:, :kept] = self.values[:, n:self.length].clone()
        self.length = kept


def layout_of(visible: torch.Tensor) -> rows.Layout:
    """The attention kernel's layout of rows that see the cache positions ``visible`` ``[T, S]``
    marks: each row's leading run from position 0, then its other positions (ascending)."""
    visible = visible.cpu()
    lead = visible.to(torch.int32).cumprod(1).sum(1)
    rest = visible & (torch.arange(visible.shape[1])[None, :] >= lead[:, None])
    start = torch.zeros(visible.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(rest.sum(1), 0, out=start[1:])
    zero = torch.zeros(visible.shape[0], dtype=torch.int32)
    return rows.Layout(zero, zero, lead.to(torch.int32), start, rest.nonzero()[:, 1].to(torch.int32))


def _packed(layer: nn.Linear, group: bool):
    """``layer``'s packed gemv weight: its stacked product's (q/k/v, gate/up) or its own, or None."""
    forward = layer.__dict__.get("forward")
    if group:
        siblings = getattr(getattr(forward, "func", None), "__self__", None)
        if siblings is None or getattr(siblings, "kind", None) != "gemv" or siblings.layers[0] is not layer \
                or siblings.bias is not None:
            return None
        return siblings.packed
    args = getattr(forward, "args", ())
    if len(args) != 4 or args[0] is not layer or args[1] is not None:
        return None
    kind, packed = packed_copy(layer.weight)
    return packed if kind == "gemv" else None


class _Table:
    """The heads' layer as the C call reads it, for the packed copies live now."""

    def __init__(self, heads) -> None:
        layer = _layer(heads)
        attn, mlp = layer.self_attn, layer.mlp
        packed = [_packed(attn.q_proj, True), _packed(attn.o_proj, False), _packed(mlp.gate_proj, True),
                  _packed(mlp.down_proj, False)]
        if any(p is None for p in packed) or len({p.dtype for p in packed}) != 1:
            raise LookupError("the heads' layer is not on live gemv packed copies")
        self.wide = _how(heads) == "wide"  # the layer reads [embedding ; feature], 2H wide
        if self.wide:
            norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm]
        else:  # EAGLE-1's layout has no input norm (an nn.Identity): the C layer reads the fused pair as is
            first = None if isinstance(layer.input_layernorm, nn.Identity) else layer.input_layernorm
            norms = [first, None, layer.post_attention_layernorm]
        self.norms = [None if n is None else n.weight.detach().float().contiguous() for n in norms]
        self.keep = packed
        self.weights = torch.tensor([0 if t is None else t.data_ptr() for t in self.norms + packed], dtype=torch.int64)
        self.half = int(packed[0].dtype == torch.bfloat16)
        config = attn.config
        heads_, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = attn.head_dim
        self.kv_heads = kv_heads
        self.eps = layer.post_attention_layernorm.variance_epsilon
        self.scale = attn.scaling
        self.residual_norm = int(getattr(layer, "norm_before_residual", False))
        self.heads = heads_
        self.inter = mlp.gate_proj.out_features


# the decoder layers (and their norms) whose computation the C call repeats: a norm before
# attention and one before the MLP, nothing else
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")  # Qwen2's only where unbiased
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


def _how(heads) -> str:
    """How the C call runs ``heads``' layer (the heads class's ``one_call``): "wide" (the layer reads
    [embedding ; feature]), "fused" (the heads' fc fuses the pair, then a stock layer), or "" (not)."""
    return getattr(heads, "one_call", "")


def _layer(heads) -> nn.Module:
    return heads.layers[0] if _how(heads) == "wide" else heads.layer


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def supported(heads) -> str | None:
    """None where :func:`step` can run ``heads``' layer (once their linears are packed), else why not.
    ``MEDUSA_ONE_CALL_DRAFTER=0`` in the environment turns it off (to compare with the modules)."""
    if os.environ.get("MEDUSA_ONE_CALL_DRAFTER", "1") == "0":
        return "MEDUSA_ONE_CALL_DRAFTER=0: the heads' modules draft"
    how = _how(heads)
    if not how or heads.fc.weight.device.type != "cpu":
        return "one-call drafting runs EAGLE-3 and EAGLE heads on a CPU"
    layer = _layer(heads)
    first = layer.input_layernorm
    if how == "fused" and (type(layer).__name__ not in LAYERS or heads.fc.bias is not None or not (
            isinstance(first, nn.Identity) or type(first).__name__ in NORMS)):
        return f"one-call drafting takes a Llama-style layer without a biased fc, not {type(layer).__name__}"
    attn, mlp = layer.self_attn, layer.mlp
    config = attn.config
    if any(getattr(m, "bias", None) is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                          mlp.gate_proj, mlp.up_proj, mlp.down_proj)) \
            or config.hidden_act != "silu":
        return "the heads' layer has biases or another activation"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return "the heads' rotary embedding is scaled"
    if gemv.unavailable_reason() is not None:
        return gemv.unavailable_reason()
    if heads.config.hidden_size % gemv.library().medusa_attention_lanes() or attn.head_dim % 2:
        return "not a shape the one-call drafter takes"
    return rows.supported_shape(config.num_attention_heads, config.num_key_value_heads, attn.head_dim)


def table(heads) -> _Table | None:
    """The heads' C table while their linears run on live gemv packed copies, else None (the modules
    draft). Called at every draft level: a table built under the live packing is reused, and the
    checks of :func:`supported` run only when one is built."""
    if os.environ.get("MEDUSA_ONE_CALL_DRAFTER", "1") == "0" or not _how(heads):
        return None
    layer = _layer(heads)
    return held_table(_tables, heads, layer.self_attn.q_proj, layer.mlp.down_proj, _checked_table)


def _checked_table(heads) -> _Table:
    reason = supported(heads)
    if reason is not None:
        raise LookupError(reason)
    return _Table(heads)


def step(heads, t: _Table, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: DraftCache,
         visible: torch.Tensor) -> torch.Tensor:
    """EagleHeads' interface on the C layer: ``features`` ``[T, L*H or H]``, ``tokens`` and ``positions``
    ``[T]``, ``visible`` ``[T, cache.length + T]`` (the cache positions each row sees, its own new pair
    included). The rows' pairs are appended to ``cache``. Returns what the heads' modules return
    ``[T, H]`` (float32): EAGLE-3's pre-norm outputs, EAGLE's layer output (after the target's final
    norm unless the layout is EAGLE-1's)."""
    return step_many(heads, t, [(features, tokens, positions, cache, visible)])[0]


def step_many(heads, t: _Table, calls: list[tuple]) -> list[torch.Tensor]:
    """:func:`step` for several sequences' rows in one C call, ``calls`` of ``(features, tokens,
    positions, cache, visible)`` with a cache each: every product reads the layer's weights once for
    all of them. A row's result is the same bits as in a call of its own (the products and the
    attention compute each row from its own values in a fixed order)."""
    target = heads.target
    one = len(calls) == 1  # (a sequence on its own, the usual call: nothing to join)
    features = calls[0][0] if one else torch.cat([f for f, _, _, _, _ in calls])
    tokens = calls[0][1].reshape(-1) if one else torch.cat([x.reshape(-1) for _, x, _, _, _ in calls])
    positions = calls[0][2].reshape(-1) if one else torch.cat([p.reshape(-1) for _, _, p, _, _ in calls])
    if t.wide:
        g = heads.fuse(features).float().contiguous()
        emb = target.get_input_embeddings()(tokens).float().contiguous()
        cos, sin = heads.rotary(g[None], positions[None])
    else:  # EAGLE: the fused pair [f ; embed(x)] through fc, as the modules compute it
        emb = target.get_input_embeddings()(tokens).to(heads.fc.weight.dtype)
        g = heads.fc(torch.cat([features.to(emb.dtype), emb], dim=-1)).float().contiguous()
        emb = None
        cos, sin = target.get_decoder().rotary_emb(g[None], positions[None])
    cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
    n, h = g.shape
    sizes = [f.shape[0] for f, _, _, _, _ in calls]
    caches = [c for _, _, _, c, _ in calls]
    for cache, rows_ in zip(caches, sizes):
        cache.reserve(cache.length + rows_)
    buffers = torch.tensor([[c.keys.data_ptr() for c in caches], [c.values.data_ptr() for c in caches],
                            [c.keys.stride(0) for c in caches], [c.keys.stride(1) for c in caches]], dtype=torch.int64)
    # each segment's row0, rows and first position, a row at a time
    segments = torch.tensor([[sum(sizes[:i]) for i in range(len(calls))], sizes, [c.length for c in caches]],
                            dtype=torch.int32)
    plan = _joined([layout_of(visible) for _, _, _, _, visible in calls])
    out = torch.empty(n, h, dtype=torch.float32)
    dims = torch.tensor([t.heads, t.kv_heads, t.dim, t.inter, len(calls)], dtype=torch.int32)
    rc = gemv.library().medusa_draft_layer(
        g.data_ptr(), None if emb is None else emb.data_ptr(), n, h, dims.data_ptr(), t.eps, t.scale,
        t.weights.data_ptr(), t.half, t.residual_norm, cos.data_ptr(), sin.data_ptr(), buffers.data_ptr(),
        segments[0].data_ptr(), segments[1].data_ptr(), segments[2].data_ptr(), plan.seg.data_ptr(),
        plan.lo.data_ptr(), plan.hi.data_ptr(), plan.start.data_ptr(), plan.extra.data_ptr(), out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the one-call drafter does not take {n} rows of {h} features")
    for cache, rows_ in zip(caches, sizes):
        cache.length += rows_
    if not t.wide and not heads.eagle1:
        norm = target.get_decoder().norm
        out = norm(out.to(norm.weight.dtype)).float()
    return list(out.split(sizes))


def _joined(plans: list[rows.Layout]) -> rows.Layout:
    """Sequences' layouts as one: segment ``i``'s rows, their runs and extra positions after the others'."""
    if len(plans) == 1:
        return plans[0]
    seg = torch.cat([torch.full_like(p.seg, i) for i, p in enumerate(plans)])
    offsets = torch.tensor([0] + [p.extra.shape[0] for p in plans[:-1]]).cumsum(0).tolist()
    start = torch.cat([plans[0].start[:1]] + [p.start[1:] + o for p, o in zip(plans, offsets)]).to(torch.int32)
    return rows.Layout(seg, torch.cat([p.lo for p in plans]), torch.cat([p.hi for p in plans]), start,
                       torch.cat([p.extra for p in plans]))
