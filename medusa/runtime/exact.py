"""Batch-invariant attention: a token's row in a tree pass is bit-identical to its one-token pass.

Why: greedy speculation promises the tokens plain decoding would give. A tree pass computes
each node's row next to other rows, and a kernel whose blocking or reduction order depends on
the number of query rows (or on where the masked keys sit) rounds differently; in bfloat16 a
near-tie of the top two logits then flips and the output changes (see
docs/exactness.md#exactness-in-bfloat16 for the per-op evidence: attention breaks invariance in bfloat16; linear layers do
past some row count on some devices, hence the engine's cap on rows per exact pass; in float32
the linear layers vary with the row count anyway).

How: every row is computed from the list of keys it may see, in cache order (the prompt, then
its ancestors) - exactly the list its one-token pass sees - with the same shapes in every pass:
the first keys, a multiple of 32 that leaves 33-64, are the prompt's cache slots, read in place
and shared by all rows of the pass; the rest are gathered per row and padded to 64. With the
matmuls, scores and weighted values are float32 products: the per-row ones (the gathered keys)
have ``g`` rows (the query heads of a KV head) in every pass, batched, and a batched matmul's
rows did not depend on the batch; the products with the shared head take ``g`` rows per query row and are padded to
at least 16 rows, because a small product's rows did depend on the row count (other kernels
for a few rows: ``_shared_product``). The reduction over keys always has the same length for
the same row (a matmul's result depended on it: 3 of 315 random cases differed by key count in
bf16). So a row's result depends neither on the other rows nor on masked slots between its keys. The
prompt, a tree and a one-token step all run through this one function.

On a CPU in half precision the arithmetic is torch's flash-attention kernel (:func:`_flash_rows`): the gathered
tail is one call with a batch entry per row, the shared head one call with every row's
queries (padded to whole query blocks: :func:`_shared_head`), merged through their
log-sum-exps. Elsewhere, in float32 and for softcapped scores, it is float32 matmuls (:func:`_group_attention`).
The flash path is the cheaper of the two for a one-token pass
(docs/exactness.md#through-the-cpu-flash-kernel-2026-11-27), and a pass runs it once per layer.

It is registered with transformers' ``AttentionInterface`` as ``"medusa_exact"`` (masks built
by transformers' eager mask function), so the stock model runs it: no forked model code.
Cost: a gather of ``n x 64`` keys per layer and small kernels; see docs/exactness.md#exactness-in-bfloat16.

Compiled exact passes (CPU): inside ``torch.compile`` the attention is one opaque custom op
(``medusa::exact_attention``), and :func:`medusa.runtime.opaque.opaque_ops` makes the two other places where inductor
rounds otherwise than eager opaque too: the RMSNorm's mean of squares and the rotary
embedding's cos and sin. With inductor's emulated precision casts for the rest, a compiled
bfloat16 pass was bit-identical to the eager one (docs/compile.md#compiled-exact-passes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from medusa.errors import MedusaError
from medusa.runtime import grouped

NAME = "medusa_exact"
_ROW_CHUNK = 64  # query rows per gather: bounds the [n, L, D] gathered keys of a long prompt
_KEY_BUCKET = 32  # key lists are padded to a multiple: a matmul's reduction over keys depends on their number
_TAIL = 64  # keys a row gathers past its shared head (a tree must be shallower than _TAIL - _KEY_BUCKET)
# Rows of an exact pass. A row's shared head must be prompt, not tree (depth <= _TAIL - _KEY_BUCKET,
# so up to 33 rows), and a device's linear kernels may change blocking past 32 rows
# (docs/exactness.md#exactness-in-bfloat16): 32 unless a device's probe found fewer (medusa/autotune/device.py).
EXACT_MAX_ROWS = min(32, _TAIL - _KEY_BUCKET + 1)
_HEAD_ROWS = 32  # matmul rows per product with the shared head's values
_MIN_ROWS = 16  # matmul rows of a product with the shared head, at least (see _shared_product)
_QUERY_PAD = 16  # the flash path's shared-head call: queries padded to a multiple (see _shared_head)
# torch's CPU flash-attention kernel, which also returns each row's log-sum-exp (_flash_rows)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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


def _width(count: int | torch.Tensor) -> int | torch.Tensor:
    """The key-list length a row that sees ``count`` keys is computed with (masked slots pad
    it): a multiple of ``_KEY_BUCKET``, so its row of every pass uses the same matmul shapes."""
    return (count + _KEY_BUCKET - 1) // _KEY_BUCKET * _KEY_BUCKET


@dataclass
class _Group:
    """Rows of one pass computed together. ``head`` > 0: their first ``head`` visible keys are
    cache slots ``0..head-1`` (read in place, shared by the rows), and ``slots`` ``[B, r, W]``
    lists the rest (visible first, in cache order, then padding); ``head`` 0: ``slots`` lists
    all of a row's keys. ``extra`` ``[B, r, head + W]``: the mask's bias, -inf on padding."""
    rows: torch.Tensor
    head: int
    slots: torch.Tensor
    extra: torch.Tensor | None  # the matmul path's bias (None in a flash plan)
    tail_bias: torch.Tensor | None = None  # flash plans: the tail's bias ``[B, r, W]`` in the query's dtype
    head_bias: torch.Tensor | None = None  # flash plans: the head's likewise; None where it is all zero


_plans: dict = {}  # the plan of the pass in flight (every layer of a pass gets the same mask)


def _plan(mask: torch.Tensor | None, n: int, length: int, device: torch.device,
          flash_dtype: torch.dtype | None = None) -> list[_Group]:
    """How each row of a pass is computed: a function of the row's own visible keys only, so
    a row gets the same computation in a tree pass as in its one-token pass.

    A row seeing ``c`` keys splits them into a head of ``h`` keys (a multiple of ``_KEY_BUCKET``:
    the fewest that leave a tail of at most ``_TAIL``) and a tail padded to ``_TAIL``. In a tree
    pass the head is prompt, never a tree node (trees are shallower than ``_TAIL - _KEY_BUCKET``),
    so all rows read it in place from one shared block, and only the tails are gathered. Rows
    whose visible keys do not start at slot 0 (sliding windows), and batches, gather all their
    keys, padded to a multiple of ``_KEY_BUCKET``."""
    allowed, bias = _visible(mask, n, length, device)
    b = allowed.shape[0]
    count = allowed.sum(-1)  # [B, n] keys each row sees
    order = torch.argsort((~allowed).to(torch.uint8), dim=-1, stable=True)  # visible first, in cache order
    leading = allowed.to(torch.int32).cumprod(-1).sum(-1)  # [B, n] visible slots 0, 1, ... before the first gap
    head = ((count - _TAIL).clamp(min=0) + _KEY_BUCKET - 1) // _KEY_BUCKET * _KEY_BUCKET  # [B, n]
    split = (leading >= head).all(0) & (b == 1)  # [n]
    # rows of one group share their head length and key-list width
    width = torch.where(split, _TAIL, _width(count.max(0).values))
    key = torch.where(split, head.max(0).values, -1) * (length + _TAIL + _KEY_BUCKET) + width
    groups = []
    for k in key.unique().tolist():
        rows = (key == k).nonzero().flatten()
        h = int(head[0, rows[0]]) if bool(split[rows[0]]) else 0
        w = int(width[rows[0]])
        slots = order[:, rows, h:h + w]
        if slots.shape[-1] < w:  # past the cache: any slot (masked below) fills the width
            slots = torch.cat([slots, slots.new_zeros(b, len(rows), w - slots.shape[-1])], -1)
        valid = torch.arange(w, device=device) < (count[:, rows] - h)[..., None]  # [B, r, W]
        tail = torch.gather(bias[:, rows], -1, slots).masked_fill(~valid, float("-inf"))
        head_bias = bias[:, rows, :h]
        if flash_dtype is None:  # the matmul path: one float32 bias over head and tail
            groups.append(_Group(rows, h, slots, torch.cat([head_bias, tail], -1).float()))
        else:
            groups.append(_Group(rows, h, slots, None, tail.to(flash_dtype),
                                 head_bias.to(flash_dtype) if bool(head_bias.any()) else None))
    return groups


def _plan_for(mask: torch.Tensor | None, n: int, length: int, device: torch.device,
              flash_dtype: torch.dtype | None) -> list[_Group]:
    """:func:`_plan`, made once per pass: the first layer makes it, the others find it."""
    key = (n, length, device, flash_dtype)
    cached = _plans.get("last")
    if cached is not None and cached[1] == key and (cached[0] is None if mask is None else
                                                    cached[0] is not None and cached[0]() is mask):
        return cached[2]
    groups = _plan(mask, n, length, device, flash_dtype)
    _plans["last"] = (None if mask is None else weakref.ref(mask), key, groups)
    return groups


def _gather(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, Hkv, L, D]`` at ``slots`` ``[B, r, W]`` -> ``[B, Hkv, r, W, D]``."""
    flat = slots.flatten(1)
    if x.shape[0] == 1:
        return x[0].index_select(1, flat[0]).unflatten(1, slots.shape[1:])[None]
    return torch.stack([x[i].index_select(1, flat[i]) for i in range(x.shape[0])]).unflatten(2, slots.shape[1:])


def _shared_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a`` ``[..., M, K]``, zero rows padding ``M`` to at least ``_MIN_ROWS``.

    A CPU float32 matmul's result for a row depends on the row count when it is small (other
    kernels for the remainder rows; on the CPUs measured, for some M up to 11 and none from 12:
    docs/exactness.md#exactness-in-bfloat16). A one-token pass of a model with
    ``g`` query heads per KV head multiplies ``g`` rows, its tree pass ``g`` per node, so
    without the padding a row of the one differs from the same row of the other."""
    m = a.shape[-2]
    if m >= _MIN_ROWS:
        return torch.matmul(a, b)
    a = torch.cat([a, a.new_zeros(*a.shape[:-2], _MIN_ROWS - m, a.shape[-1])], -2)
    return torch.matmul(a, b)[..., :m, :]


def _group_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: _Group,
                     scaling: float, softcap: float | None) -> torch.Tensor:
    """Attention for a group's rows: q ``[B, Hkv, r, g, D]`` -> ``[B, Hkv, r, g, D]``."""
    b, kv_heads, r, g, dim = q.shape
    h = group.head
    # float32 arithmetic: small float32 matmuls were faster than bfloat16's where measured, and
    # their rows did not depend on the row count or the batch (docs/exactness.md#exactness-in-bfloat16)
    q = q.float()
    keys, values = _gather(key, group.slots).float(), _gather(value, group.slots).float()  # [B, Hkv, r, W, D]
    if h:
        head_keys, head_values = key[:, :, :h].float(), value[:, :, :h].float()
    scores = torch.matmul(q, keys.transpose(-1, -2))  # [B, Hkv, r, g, W]
    if h:
        # the shared head: one matmul for all rows (each score is a dot product over D)
        shared = _shared_product(q.reshape(b, kv_heads, r * g, dim), head_keys.transpose(-1, -2))
        scores = torch.cat([shared.view(b, kv_heads, r, g, h), scores], -1)
    scores = scores * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + group.extra[:, None, :, None, :]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs[..., h:], values)  # [B, Hkv, r, g, D]
    if h:
        # the head's weighted values, at most _HEAD_ROWS matmul rows at a time: a long
        # reduction's kernel may block differently for more rows
        step = max(1, _HEAD_ROWS // g)
        parts = [_shared_product(probs[:, :, s:s + step, :, :h].reshape(b, kv_heads, -1, h), head_values)
                 for s in range(0, r, step)]
        out = torch.cat(parts, 2).view(b, kv_heads, r, g, dim) + out
    return out


def _flash_rows(rows_q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: _Group,
                scaling: float) -> torch.Tensor:
    """Attention for a group's rows on a CPU with torch's flash kernel: rows_q ``[B*r, Hkv, g, D]``
    -> ``[B*r, Hkv, g, D]`` (float32).

    The tail (gathered keys, -inf on padding) is one call with each row its own batch entry:
    the kernel computes every (batch entry, KV head) on its own with the same code, blocked by
    the query length (``g``, fixed per model) and the key count (fixed per row: the tail's
    width), so a row's result does not depend on the other rows; measured bit-identical in
    bfloat16 (tests/test_exact.py); float32 takes the matmul path (see :func:`_attention`). The
    shared head is one call for all rows (:func:`_shared_head`). The two are merged with their log-sum-exps through a row-wise softmax
    over the pair, whose code path is the same for every row (elementwise kernels may compute
    a tensor's last few elements with other code than the vectorised body, so they must not
    see the lse itself)."""
    out, lse = _FLASH(rows_q, _gather_rows(key, group.slots), _gather_rows(value, group.slots),
                      attn_mask=_row_bias(group.tail_bias), scale=scaling)
    h = group.head
    if not h:
        return out.float()
    head_out, head_lse = _shared_head(rows_q, key, value, h, group.head_bias, scaling)  # b == 1 for split groups
    weights = torch.softmax(torch.stack([head_lse, lse], -1), -1)  # [r, Hkv, g, 2]
    return head_out * weights[..., :1] + out * weights[..., 1:]


def _shared_head(rows_q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, h: int, bias: torch.Tensor | None,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every row over the shared head (cache slots ``0..h-1``, read in place), as
    one flash call whose queries are all rows' (``r x g`` per KV head): rows_q ``[r, Hkv, g, D]``
    -> ``(out [r, Hkv, g, D], lse [r, Hkv, g])``.

    The kernel's matmuls compute a query's scores with other code when a block of queries has
    a few rows left over (one call with the rows' 3-99 queries: 1-2 leftover queries differed
    in bfloat16), so the queries are padded with zero rows to a multiple of ``_QUERY_PAD``:
    then every row's result was bit-identical to its one-row call for 1-33 rows, 1-8 queries
    per KV head, head dims 64-256 and 32-544 keys, in bfloat16 and float32 (28,000 rows; 1,668
    of 13,440 differed when padding to 4). One call instead of a batch entry per row: per-row calls
    over the shared head were most of a row's cost (docs/exactness.md#the-shared-head-in-one-call-2026-11-27-later)."""
    r, kv_heads, g, dim = rows_q.shape
    m = r * g
    q = rows_q.new_zeros(1, kv_heads, -(-m // _QUERY_PAD) * _QUERY_PAD, dim)
    q[0, :, :m].view(kv_heads, r, g, dim).copy_(rows_q.transpose(0, 1))
    mask = None
    if bias is not None:  # [1, r, h] -> a row per query, zero on the padding queries
        mask = bias.new_zeros(1, 1, q.shape[2], h)
        mask[0, 0, :m].view(r, g, h).copy_(bias[0, :, None, :].expand(r, g, h))
    out, lse = _FLASH(q, key[:, :, :h], value[:, :, :h], attn_mask=mask, scale=scaling)
    return (out[0, :, :m].reshape(kv_heads, r, g, dim).transpose(0, 1),
            lse[0, :, :m].reshape(kv_heads, r, g).transpose(0, 1))


def _row_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, r, W]`` -> ``[B*r, 1, 1, W]``: one batch entry per row, shared by its heads and queries."""
    return None if bias is None else bias.flatten(0, 1)[:, None, None]


def _gather_rows(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, Hkv, L, D]`` at ``slots`` ``[B, r, W]`` -> ``[B*r, Hkv, W, D]`` (a view of one copy)."""
    return _gather(x, slots).transpose(1, 2).flatten(0, 1)


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query ``[B, H, n, D]``, key/value ``[B, Hkv, L, D]``,
    mask ``[B, 1, n, L]``; returns ``([B, n, H, D], None)``. Inference only (no dropout).

    Inside a compiled pass it is one opaque op (:func:`attention_op`): the per-pass plan is
    data-dependent Python, and the op runs exactly the eager code, so a compiled pass's
    attention is bit-identical to an eager one's (docs/compile.md#compiled-exact-passes)."""
    if torch.compiler.is_compiling():
        return torch.ops.medusa.exact_attention(query, key, value, attention_mask, scaling, softcap), None
    return _attention(query, key, value, attention_mask, scaling, softcap), None


@torch.library.custom_op("medusa::exact_attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                 scaling: float | None, softcap: float | None) -> torch.Tensor:
    """:func:`exact_attention` as a custom op that compilers leave alone: ``[B, n, H, D]``."""
    return _attention(query, key, value, attention_mask, scaling, softcap)


@attention_op.register_fake
def _(query, key, value, attention_mask, scaling, softcap):
    b, heads, n, dim = query.shape
    return query.new_empty(b, n, heads, dim)


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float | None, softcap: float | None) -> torch.Tensor:
    """:func:`exact_attention`'s arithmetic: ``[B, n, H, D]``, contiguous."""
    b, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = dim ** -0.5 if scaling is None else scaling
    # torch's CPU flash kernel in float32 changed a batch entry's result with the batch size when
    # it ran on several threads (docs/exactness.md#the-flash-path-in-float32): half precision only
    flash = (query.device.type == "cpu" and softcap is None and _FLASH is not None
             and query.dtype in (torch.bfloat16, torch.float16))
    plan = _plan_for(attention_mask, n, length, query.device, query.dtype if flash else None)
    if flash:
        rows = query.transpose(1, 2).reshape(b, n, kv_heads, groups, dim)  # [B, n, Hkv, g, D]
        if len(plan) == 1 and n <= _ROW_CHUNK:
            out = _flash_rows(rows.flatten(0, 1), key, value, plan[0], scaling)
            return out.reshape(b, n, heads, dim).to(query.dtype)
        out = query.new_empty(b, n, kv_heads, groups, dim)
        for part in _chunks(plan):
            flat = rows[:, part.rows].flatten(0, 1)
            out[:, part.rows] = _flash_rows(flat, key, value, part, scaling).unflatten(0, (b, -1)).to(out.dtype)
        return out.reshape(b, n, heads, dim)
    # the g query heads that share a KV head become the M rows of one small matmul per query row
    q = query.view(b, kv_heads, groups, n, dim).transpose(2, 3)  # [B, Hkv, n, g, D]
    if len(plan) == 1 and n <= _ROW_CHUNK:  # one group of all rows in order (a step, most trees)
        out = _group_attention(q, key, value, plan[0], scaling, softcap).to(query.dtype)
        return out.transpose(2, 3).reshape(b, heads, n, dim).transpose(1, 2).contiguous()
    out = torch.empty_like(q)
    for part in _chunks(plan):
        out[:, :, part.rows] = _group_attention(q[:, :, part.rows], key, value, part, scaling, softcap).to(out.dtype)
    return out.transpose(2, 3).reshape(b, heads, n, dim).transpose(1, 2).contiguous()


def _chunks(plan: list[_Group]):
    """The plan's groups, at most ``_ROW_CHUNK`` rows each (bounds a long prompt's gathered keys)."""
    for group in plan:
        for s in range(0, len(group.rows), _ROW_CHUNK):
            part = slice(s, s + _ROW_CHUNK)
            yield _Group(group.rows[part], group.head, *(None if x is None else x[:, part] for x in
                                                         (group.slots, group.extra, group.tail_bias, group.head_bias)))


AttentionInterface.register(NAME, exact_attention)
AttentionMaskInterface.register(NAME, eager_mask)  # additive masks, always materialised


def set_exact(model: PreTrainedModel, exact: bool) -> None:
    """Run ``model``'s attention batch-invariantly (``exact=True``) or with SDPA, the query heads
    of a KV head grouped on a CPU (False: medusa/runtime/grouped.py; transformers' own elsewhere)."""
    cpu = model.get_output_embeddings().weight.device.type == "cpu"
    model.set_attn_implementation(NAME if exact else grouped.NAME if cpu else "sdpa")


def is_exact(model: PreTrainedModel) -> bool:
    return model.config._attn_implementation == NAME


def pass_rows(exact: bool, max_rows: int | None) -> int | None:
    """Rows per verification pass (None: any). Exact attention makes attention row-invariant,
    but a device's matmul kernels may block differently past some row count, so exact passes
    verify at most the rows the device's probe found invariant (medusa.load passes the dtype
    pick's ``invariant_rows``) and never more than exact attention supports; larger proposals
    keep their first nodes."""
    if max_rows is not None and max_rows < 1:
        raise MedusaError(f"max_rows must be at least 1, got {max_rows}")
    return min(max_rows or EXACT_MAX_ROWS, EXACT_MAX_ROWS) if exact else max_rows


def use_exact(model: PreTrainedModel, exact: bool | None, compile: bool | str) -> bool:
    """Set ``model``'s attention batch-invariant or not and return which (this module:
    a tree row equals its one-token pass bit for bit). None: on in half precision, where
    kernels' row-count-dependent rounding flips near-ties; off in float32, whose linear kernels
    vary with the row count anyway (docs/exactness.md#exactness-in-bfloat16). ``compile``: the
    engine's, ``"auto"`` excluded (it never compiles off the CPU)."""
    if exact is None:
        exact = model.dtype in (torch.bfloat16, torch.float16)
    device = model.get_output_embeddings().weight.device
    # A compiled exact pass is bit-identical to the eager one on the CPU only: attention and
    # the norms' reduction run as opaque ops (medusa/runtime/exact.py), the rest with inductor's
    # emulated precision casts (kv.compile_options). CUDA graphs cannot capture attention's per-pass plan.
    if compile and exact and device.type != "cpu":
        raise MedusaError(f"compile=True with exact attention (a bfloat16/float16 target) runs on the CPU only, "
                          f"not {device.type}: load the target in float32 (dtype='float32') or drop compile")
    # SDPA's passes of several rows group the query heads of a KV head (medusa/runtime/grouped.py)
    if exact != is_exact(model) or (not exact and model.config._attn_implementation == "sdpa"):
        set_exact(model, exact)
    return exact
