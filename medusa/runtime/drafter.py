"""An EAGLE-3 drafter layer in one C call (``decoder.c``'s ``medusa_eagle3_layer``), on the heads' own weights.

Why: drafting runs the heads' one decoder layer on a handful of rows several times a step (each
level of the draft tree, and the update with what the target accepted), and through the modules
each call spends longer on the layer's small operations and the calls around them than on its
products (docs/performance.md#a-drafter-layer-in-one-call). Here the layer's norms, products (the packed
copies a live :class:`~medusa.runtime.kernels.PackedLinears` holds, bfloat16 or float32, on the
gemv kernels), rotary embedding, cache writes, attention (:mod:`medusa.runtime.rows`'s kernel,
each row over the pairs it sees) and MLP run in one call, in float32.

The heads' cache is a :class:`DraftCache` (float32 key/value buffers); masks become the attention
kernel's layout (:func:`layout_of`). Drafts only propose: the target verifies every token, so the
float32 arithmetic here (against the modules' bfloat16) changes which drafts are tried, never the
output (tests/test_drafter.py checks both paths agree to bfloat16 rounding).

Where: :class:`~medusa.models.eagle3_heads.Eagle3Heads` on a CPU whose heads' linear layers run
on the gemv kernels (``kernels="gemv"``, entered), with Llama-style rotary and no biases
(:func:`table` returns None otherwise and the proposer keeps the modules).
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
        layer = heads.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        packed = [_packed(attn.q_proj, True), _packed(attn.o_proj, False), _packed(mlp.gate_proj, True),
                  _packed(mlp.down_proj, False)]
        if any(p is None for p in packed) or len({p.dtype for p in packed}) != 1:
            raise LookupError("the heads' layer is not on live gemv packed copies")
        norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm]
        self.norms = [n.weight.detach().float().contiguous() for n in norms]
        self.keep = packed
        self.weights = torch.tensor([t.data_ptr() for t in self.norms + packed], dtype=torch.int64)
        self.half = int(packed[0].dtype == torch.bfloat16)
        config = heads.layer_config
        heads_, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // heads_
        self.dims = torch.tensor([heads_, kv_heads, self.dim, config.intermediate_size], dtype=torch.int32)
        self.kv_heads = kv_heads
        self.eps = layer.input_layernorm.variance_epsilon
        self.scale = attn.scaling
        self.residual_norm = int(layer.norm_before_residual)


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def supported(heads) -> str | None:
    """None where :func:`step` can run ``heads``' layer (once their linears are packed), else why not.
    ``MEDUSA_ONE_CALL_DRAFTER=0`` in the environment turns it off (to compare with the modules)."""
    if os.environ.get("MEDUSA_ONE_CALL_DRAFTER", "1") == "0":
        return "MEDUSA_ONE_CALL_DRAFTER=0: the heads' modules draft"
    if getattr(heads, "kind", None) != "eagle3" or heads.fc.weight.device.type != "cpu":
        return "one-call drafting runs EAGLE-3 heads on a CPU"
    layer = heads.layers[0]
    config = heads.layer_config
    if config.attention_bias or getattr(config, "mlp_bias", False) or config.hidden_act != "silu":
        return "the heads' layer has biases or another activation"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return "the heads' rotary embedding is scaled"
    if gemv.unavailable_reason() is not None:
        return gemv.unavailable_reason()
    if heads.config.hidden_size % gemv.library().medusa_attention_lanes() or layer.self_attn.head_dim % 2:
        return "not a shape the one-call drafter takes"
    return rows.supported_shape(config.num_attention_heads, config.num_key_value_heads, layer.self_attn.head_dim)


def table(heads) -> _Table | None:
    """The heads' C table while their linears run on live gemv packed copies, else None (the modules
    draft). Called at every draft level: a table built under the live packing is reused, and the
    checks of :func:`supported` run only when one is built."""
    if os.environ.get("MEDUSA_ONE_CALL_DRAFTER", "1") == "0" or getattr(heads, "kind", None) != "eagle3":
        return None
    layer = heads.layers[0]
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
    included). The rows' pairs are appended to ``cache``. Returns the pre-norm outputs ``[T, H]`` (float32)."""
    g = heads.fuse(features).float().contiguous()
    emb = heads.target.get_input_embeddings()(tokens).float().contiguous()
    cos, sin = heads.rotary(g[None], positions[None])
    cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
    n, h = g.shape
    start = cache.length
    cache.reserve(start + n)
    plan = layout_of(visible)
    out = torch.empty(n, h, dtype=torch.float32)
    k, v = cache.keys, cache.values
    addresses = torch.tensor([k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1)], dtype=torch.int64)
    rc = gemv.library().medusa_eagle3_layer(g.data_ptr(), emb.data_ptr(), n, h, t.dims.data_ptr(), t.eps, t.scale,
                                            t.weights.data_ptr(), t.half, t.residual_norm, cos.data_ptr(),
                                            sin.data_ptr(), addresses.data_ptr(), start, plan.lo.data_ptr(),
                                            plan.hi.data_ptr(), plan.start.data_ptr(), plan.extra.data_ptr(),
                                            out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the one-call drafter does not take {n} rows of {h} features")
    cache.length = start + n
    return out
