"""A decoding pass of a Llama-style target in one C call (``decoder.c``), on the model's own weights.

Why: with the products on the gemv kernels and attention in one call per layer, a one-token pass
of the embedded model still spent ~11 ms of its ~26 in the decoder's small operations - the
norms, the rotary embedding, the residual adds, the activation - and in the Python module calls
around them (docs/performance.md#one-call-passes). Here every layer of a pass runs inside one
call: the same weights (the packed copies :class:`~medusa.runtime.kernels.PackedLinears` holds
while entered), the same caches and the same attention kernel (:mod:`medusa.runtime.rows`); the
cos/sin of the rotary embedding come from the model's own module, and the vocabulary projection
stays the model's (:func:`medusa.runtime.hf.lm_logits`).

Where: verification passes (packed or alone) of float32 Llama, Qwen2 and Mistral decoders on a
CPU whose linear layers run the gemv kernels for every row count (``kernels="gemv"``), with the
one-call attention's layout (:func:`supported`; :class:`~medusa.decoding.passes.strategies.PassStrategy`
decides). Anything else - prompts, other architectures, half precision, other kernels - runs
:func:`medusa.runtime.hf.forward`.

Exactness: each row is computed from its own values in a fixed order (decoder.c), so a row's bits
are the same alone, in a tree or beside other sequences, as with the module path; the two paths
round the small operations differently (within float32 rounding), so a generation runs one of
them for all its decoding passes (tests/test_native.py).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa.runtime import clock, gemv, rows
from medusa.runtime import hf as kv
from medusa.runtime.kernels import packed_copy

ARCHITECTURES = ("llama", "qwen2", "mistral")
LO, FEATURE, FIELDS = 10, 11, 12  # decoder.c's table: the layout's lo and the feature slot of each layer
_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


def supported(model: PreTrainedModel) -> str | None:
    """None where :func:`forward` runs ``model``'s decoding passes in one call, else why not (one line).
    ``MEDUSA_ONE_CALL_PASSES=0`` in the environment turns them off (to compare with the module path)."""
    if os.environ.get("MEDUSA_ONE_CALL_PASSES", "1") == "0":
        return "MEDUSA_ONE_CALL_PASSES=0: the model's modules run every pass"
    config = kv.text_config(model)
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"a {getattr(config, 'model_type', '?')} decoder: one-call passes run {', '.join(ARCHITECTURES)}"
    reason = rows.supported(model)
    if reason is not None:
        return reason
    if getattr(config, "hidden_act", None) != "silu" or config.hidden_size % gemv.library().medusa_attention_lanes():
        return f"a {config.hidden_act} MLP over {config.hidden_size} features: not a shape the one-call pass takes"
    decoder = model.get_decoder()
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm, decoder.norm)
        if any(type(n).__name__ not in _NORMS for n in norms) or hasattr(attn, "q_norm"):
            return "the decoder's norms are not the Llama-style RMSNorm"
        if not all(isinstance(getattr(attn, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "the attention's projections are not linear layers"
        if not all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
            return "the MLP's projections are not linear layers"
    return None


def _stacked(layer: nn.Linear):
    """The stacked product (q/k/v or gate/up) a live PackedLinears runs ``layer`` in, if gemv for every row count."""
    forward = layer.__dict__.get("forward")
    siblings = getattr(getattr(forward, "func", None), "__self__", None)
    if siblings is None or getattr(siblings, "kind", None) != "gemv" or siblings.max_rows or siblings.stock_rows:
        return None
    return siblings


def _single(layer: nn.Linear) -> torch.Tensor | None:
    """``layer``'s packed gemv weight, if a live PackedLinears runs it by gemv for every row count."""
    forward = layer.__dict__.get("forward")
    args = getattr(forward, "args", ())
    if len(args) != 4 or args[0] is not layer or args[2] is not None or args[3] is not None:
        return None
    kind, packed = packed_copy(layer.weight)
    return packed if kind == "gemv" else None


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class _Table:
    """Each layer's weight addresses (decoder.c's table) for the packed copies live now."""

    def __init__(self, model: PreTrainedModel) -> None:
        decoder = model.get_decoder()
        if gemv.library().medusa_decoder_fields() != FIELDS:
            raise LookupError("the kernel library's decoder table is not this module's")
        self.keep, values = [], []  # keep: the packed copies this table points into
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = _stacked(attn.q_proj), _stacked(mlp.gate_proj)
            o, down = _single(attn.o_proj), _single(mlp.down_proj)
            if qkv is None or gate_up is None or o is None or down is None or qkv.layers[0] is not attn.q_proj \
                    or gate_up.layers[0] is not mlp.gate_proj:
                raise LookupError("the decoder's layers are not all on live gemv packed copies")
            self.keep += [qkv, gate_up, o, down]
            row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   qkv.packed.data_ptr(), _address(qkv.bias), o.data_ptr(), _address(attn.o_proj.bias),
                   gate_up.packed.data_ptr(), _address(gate_up.bias), down.data_ptr(), _address(mlp.down_proj.bias),
                   0, -1]
            values.append(row)
        self.rows = torch.tensor(values, dtype=torch.int64)  # [layers, fields]
        # what every pass reads, looked up once (a transformers config attribute costs microseconds)
        config = kv.text_config(model)
        self.decoder, self.count = decoder, len(decoder.layers)
        self.types = getattr(config, "layer_types", None)
        heads, kv_heads, self.dim = rows.attention_shape(model)
        self.shape = (heads, kv_heads, self.dim, config.intermediate_size)
        self.eps = decoder.norm.variance_epsilon
        self.scale = getattr(decoder.layers[0].self_attn, "scaling", self.dim ** -0.5)


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def held_table(tables: weakref.WeakKeyDictionary, owner, first: nn.Linear, last: nn.Linear, build):
    """``build(owner)``, kept in ``tables`` while the live PackedLinears' forwards of ``first`` and
    ``last`` are the ones it was built under (held, so never confused with a later one's); None
    where ``build`` raises LookupError or RuntimeError (not entered, or another kernel)."""
    probe = (first.__dict__.get("forward"), last.__dict__.get("forward"))
    held = tables.get(owner)
    if held is not None and held[0][0] is probe[0] and held[0][1] is probe[1]:
        return held[1]
    try:
        made = build(owner)
    except (LookupError, RuntimeError):
        return None
    tables[owner] = (probe, made)
    return made


def _table(model: PreTrainedModel) -> _Table | None:
    decoder = model.get_decoder()
    return held_table(_tables, model, decoder.layers[0].self_attn.q_proj, decoder.layers[-1].mlp.down_proj, _Table)


def _addresses(cache, buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[layers, 4]``: each layer's key and value buffer addresses, head and position strides;
    kept on ``cache`` until a buffer moves (they grow by doubling: rarely)."""
    key = (buffers[0][0].shape, *(k.data_ptr() for k, _ in buffers))  # a regrown buffer moves
    held = getattr(cache, "_medusa_addresses", None)
    if held is not None and held[0] == key:
        return held[1]
    table = torch.tensor([[k.data_ptr(), v.data_ptr(), k.stride(1), k.stride(2)] for k, v in buffers], dtype=torch.int64)
    cache._medusa_addresses = (key, table)
    return table


def forward(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
            attention_mask, logits_rows: torch.Tensor | slice | None = None, cache_arg: str | None = None,
            layers: tuple[int, ...] | None = None, vocab: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`medusa.runtime.hf.forward`'s signature and results. A packed pass with the one-call
    attention's layout (:func:`medusa.runtime.packed.forward`) on gemv packed copies runs in one
    C call; any other pass goes to :func:`medusa.runtime.hf.forward`."""
    layout = rows._active.layout
    buffers = getattr(cache, "buffers", None)
    table = _table(model) if layout is not None and buffers is not None else None
    if table is None or (layers is not None and max(layers) >= table.count):
        return kv.forward(model, input_ids, position_ids, cache, attention_mask, logits_rows, cache_arg, layers, vocab)
    return _run(model, table, input_ids, position_ids, cache, layout, buffers, logits_rows, layers, vocab)


def _run(model, table: _Table, input_ids, position_ids, pack, layout, buffers, logits_rows, layers, vocab):
    decoder = table.decoder
    x = decoder.embed_tokens(input_ids)[0].contiguous()  # [R, H], written in place
    cos, sin = decoder.rotary_emb(x[None], position_ids)
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    R, H = x.shape
    entries = table.rows.clone()
    if isinstance(layout.lo, dict):  # sliding-window layers see less than full ones
        entries[:, LO] = torch.tensor([layout.lo[t].data_ptr() for t in table.types])
    else:
        entries[:, LO] = layout.lo.data_ptr()
    feats = None
    if layers is not None:
        feats = torch.empty(R, len(layers) * H, dtype=torch.float32)
        entries[list(layers), FEATURE] = torch.arange(len(layers))
    # [layers, 4, sequences]: each sequence's key and value buffers and their strides, layer by layer
    caches = torch.stack([_addresses(s.cache, b) for s, b in zip(pack.segments, buffers)], dim=-1)
    dims = torch.tensor([*table.shape, len(buffers)], dtype=torch.int32)
    out = torch.empty(R, H, dtype=torch.float32)
    done = clock.charged(
        "native", gemv.library().medusa_decoder, x.data_ptr(), R, H, table.count, entries.data_ptr(),
        caches.data_ptr(), dims.data_ptr(), table.eps, table.scale, cos.data_ptr(), sin.data_ptr(), pack._row0,
        pack._rows, pack._start, layout.seg.data_ptr(), layout.hi.data_ptr(), layout.start.data_ptr(),
        layout.extra.data_ptr(), _address(feats), 0 if layers is None else len(layers), decoder.norm.weight.data_ptr(),
        out.data_ptr(), torch.get_num_threads())
    if done != 0:
        raise ValueError(f"the one-call pass does not take head size {table.dim} with {table.shape[0]} heads")
    rows_out = out if logits_rows is None else out[logits_rows]
    logits = (vocab or kv.lm_logits)(model, rows_out).float()
    return logits, (out if feats is None else feats)
