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

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from medusa.errors import MedusaError
from medusa.runtime.buffered import BufferedLayer


def new_cache(buffered: bool = True) -> DynamicCache:
    """A dynamic cache of full-length layers: ``BufferedLayer`` for decoding; plain
    concatenating layers (``buffered=False``) where gradients flow through the cache
    (training), since a buffer written in place would overwrite saved activations."""
    # Built without the model config on purpose: every layer is then a plain full-length
    # layer we can compact and crop freely; sliding windows are applied by the masks.
    cache = DynamicCache()
    if buffered:
        cache.layer_class_to_replicate = BufferedLayer
    return cache


def new_static_cache(model: PreTrainedModel, capacity: int) -> Cache:
    """A cache of ``capacity`` slots per layer at fixed addresses (see the module docstring)."""
    layers = text_config(model).num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(layers)])


def is_static(cache: Cache) -> bool:
    return bool(cache.layers) and isinstance(cache.layers[0], StaticLayer)


def capacity(cache: Cache) -> int | None:
    """Slots of a static cache (``None``: a dynamic cache, which grows)."""
    return cache.layers[0].max_cache_len if is_static(cache) else None


def reserve(cache: Cache, needed: int, step: int | None = None) -> None:
    """Make a static cache hold at least ``needed`` positions: a larger one replaces each
    layer's tensors, keeping the cached entries. Dynamic caches grow alone. The new size is
    the next power of two (at least 256), or with ``step`` the next multiple of it (at least
    256): attention reads every slot, so a capacity close to the length costs less per pass,
    where the capacity is symbolic in the compiled pass (:func:`mark_capacity_dynamic`)."""
    if not is_static(cache) or cache.layers[0].max_cache_len >= needed:
        return
    needed = max(needed, 256)
    size = -(-needed // step) * step if step else 1 << (needed - 1).bit_length()
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
    for layer in cache.layers:
        held = layer.__dict__.get("held")
        if held is not None:  # a held buffered layer: its views stay unmade
            layer.hold(min(held, length))
            continue
        if not getattr(layer, "is_initialized", False) or layer.keys is None:
            continue
        if isinstance(layer, StaticLayer):
            with torch.inference_mode():  # the counter may be an inference tensor
                layer.cumulative_length.fill_(length)
        elif layer.keys.shape[-2] != length:  # most steps keep every row they verified: nothing to cut
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def drop_front(cache: Cache, n: int) -> None:
    """Forget a dynamic cache's first ``n`` positions: the kept ones move to the front (of a
    ``BufferedLayer``'s buffer, where its next update appends), keeping their rotary phases."""
    for layer in _layers(cache):
        kept_k, kept_v = layer.keys[..., n:, :].clone(), layer.values[..., n:, :].clone()
        layer.keys, layer.values = layer.keys[..., :kept_k.shape[-2], :], layer.values[..., :kept_v.shape[-2], :]
        layer.keys.copy_(kept_k)
        layer.values.copy_(kept_v)


def copy_prefix(cache: Cache, length: int, model: PreTrainedModel) -> Cache:
    """A new cache of the same kind holding a copy of the first ``length`` positions of
    ``cache`` (which stays untouched): a branch from a state whose cache another generation
    has taken since. Copies ``length`` entries per layer, nothing more."""
    static = is_static(cache)
    new = new_static_cache(model, capacity(cache)) if static else new_cache()
    with torch.inference_mode():
        for i, old in enumerate(_layers(cache)):
            keys, values = old.keys[..., :length, :], old.values[..., :length, :]  # [B, H_kv, length, D]
            if not static:
                new.update(keys.clone(), values.clone(), i)
                continue
            layer = new.layers[i]
            layer.lazy_initialization(old.keys, old.values)
            layer.keys[..., :length, :] = keys
            layer.values[..., :length, :] = values
            layer.cumulative_length.fill_(length)
    return new


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


def text_config(model: PreTrainedModel) -> PretrainedConfig:
    """The config of the language model: composite models (Gemma-3 4B and up, loaded by
    ``AutoModelForCausalLM`` as ``...ForConditionalGeneration``) keep the sliding window,
    layer types, context length and logit post-processing in a nested text config."""
    return model.config.get_text_config()


def _sliding_window(model: PreTrainedModel) -> int | None:
    return getattr(text_config(model), "sliding_window", None)


def _layer_types(model: PreTrainedModel) -> list[str] | None:
    return getattr(text_config(model), "layer_types", None)


# Layers whose state is not a per-position KV cache (Mamba, linear attention, short
# convolutions) cannot score a tree: sibling branches would all update one recurrent state.
_RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "granitemoehybrid",
    "nemotron_h", "rwkv", "recurrent_gemma", "xlstm", "lfm2", "lfm2_moe", "lfm2_vl", "qwen3_next", "minimax",
    "plamo2",
})
_RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "hybrid", "conv", "recurrent"})
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


def check_architecture(model: PreTrainedModel) -> None:
    """Refuse recurrent or linear-attention layers (Mamba, Jamba, Qwen3-Next, LFM2, ...) and
    attention kinds the tree mask does not model (e.g. Llama-4's chunked attention): from the
    config alone, so :func:`medusa.models.target.load_target` refuses before running anything."""
    config = text_config(model)
    name = type(model).__name__
    kinds = set(getattr(config, "layer_types", None) or []) | set(getattr(config, "layers_block_type", None) or [])
    other = sorted(kinds - _ATTENTION_LAYER_TYPES)
    if config.model_type in _RECURRENT_MODEL_TYPES or set(other) & _RECURRENT_LAYER_TYPES:
        raise MedusaError(f"{name} has {', '.join(other) or 'recurrent'} layers, whose state is not a per-position KV "
                          "cache, so a tree of candidates cannot be verified in one pass: use an attention-only model")
    if other:
        raise MedusaError(f"{name} has {', '.join(other)} layers, an attention pattern the tree mask does not model: "
                          "use a model with full or sliding-window attention")


def check_target(model: PreTrainedModel) -> None:
    """Refuse, with a one-line MedusaError, a model whose output tree decoding would get wrong:
    see :func:`check_architecture`, or logits post-processed in a way :func:`lm_logits` does
    not reproduce (checked on a 4-token input against the model's own forward)."""
    check_architecture(model)
    name = type(model).__name__
    device = model.get_output_embeddings().weight.device
    ids = torch.tensor([[1, 2, 3, 4]], device=device) % model.get_output_embeddings().weight.shape[0]
    with torch.inference_mode():
        own = model(input_ids=ids, use_cache=False).logits[0].float()  # [4, V]
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]  # [4, H]
        ours = lm_logits(model, hidden).float()
    if own.shape != ours.shape or not torch.allclose(own, ours, atol=1e-3 * (1 + float(own.abs().max())), rtol=1e-3):
        raise MedusaError(f"{name} post-processes its logits in a way medusa does not know (not the lm_head of the final "
                          "hidden state with Gemma's softcap, Cohere's logit_scale or Granite's logits_scaling): "
                          "it is not supported")


def lm_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits ``[..., V]`` from its final (normed) hidden states ``[..., H]``,
    computed exactly as the model's own forward does: the ``lm_head`` then the head's
    post-processing (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma's tanh
    softcap). In the ``lm_head``'s dtype. Every caller (decoding, training, draft heads)
    uses this one function.

    The settings are read where transformers' own classes read them: the top-level config,
    the text config for the scales of composite models (Granite vision); the softcap from the
    top level only, as composite Gemma-3 (``Gemma3ForConditionalGeneration``) applies none.
    :func:`check_target` verifies the result against the model's forward."""
    top, text = model.config, text_config(model)
    head = model.get_output_embeddings()
    logits = head(hidden.to(head.weight.dtype))
    scale = getattr(top, "logit_scale", None) or getattr(text, "logit_scale", None)  # Cohere: multiplied
    if scale is not None:
        logits = logits * scale
    divisor = getattr(top, "logits_scaling", None) or getattr(text, "logits_scaling", None)  # Granite: divided
    if divisor is not None:
        logits = logits / divisor
    cap = getattr(top, "final_logit_softcapping", None)  # Gemma 2/3 text models
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def tree_attention_mask(model: PreTrainedModel, past: int, ancestor: torch.Tensor, depth: torch.Tensor,
                        dtype: torch.dtype, kv_len: int | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
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


@functools.cache
def _cache_name(function) -> str:
    params = inspect.signature(function).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which ``model``'s decoder takes its KV cache (see :func:`cache_kwarg`)."""
    forward = model.get_decoder().forward
    return _cache_name(getattr(forward, "__func__", forward))


def cache_kwarg(method, cache: Cache | None) -> dict:
    """``{name: cache}`` for ``method`` (a model's, a layer's or ``generate``): transformers
    renamed ``past_key_values`` to ``cache`` (5.24 warns on the old name), older 5.x only
    knows ``past_key_values``."""
    return {_cache_name(getattr(method, "__func__", method)): cache}


def forward(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Cache,
            attention_mask: torch.Tensor | dict[str, torch.Tensor] | None,
            logits_rows: torch.Tensor | slice | None = None, cache_arg: str | None = None,
            layers: tuple[int, ...] | None = None, vocab: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target pass over ``[1, n]`` new tokens; appends them to ``cache``.

    Returns ``(logits [r, V], hidden [n, H])`` where ``hidden`` is the final (normed)
    hidden state the ``lm_head`` reads and ``logits`` covers only ``logits_rows`` (all rows
    by default): projecting every prompt position to the vocabulary would be wasted work.
    ``attention_mask=None`` means plain causal attention (transformers builds it).
    ``cache_arg``: the decoder's name for the cache argument (:func:`cache_argument`), given
    by compiled callers so that the traced pass does not inspect signatures. ``layers``: return,
    instead of the final hidden state, the residual stream entering each of these layers,
    concatenated ``[n, len(layers) * H]`` (EAGLE-3 heads' features). ``vocab``: computes the
    logits from ``(model, rows)`` instead of :func:`lm_logits` (a vocabulary screen,
    medusa/runtime/screen.py).
    """
    base = model.get_decoder()
    kwargs = {cache_arg: cache} if cache_arg is not None else cache_kwarg(base.forward, cache)
    out = base(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
               output_hidden_states=layers is not None, **kwargs)
    hidden = out.last_hidden_state[0]  # [n, H]
    rows = hidden if logits_rows is None else hidden[logits_rows]
    logits = (vocab or lm_logits)(model, rows).float()  # [r, V]
    if layers is not None:
        hidden = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)  # [n, L * H]
    return logits, hidden


def features(model: PreTrainedModel, ids: torch.Tensor, layers: tuple[int, ...] | None = None) -> torch.Tensor:
    """One uncached pass over ``ids`` ``[T]``: the final hidden states ``[T, H]``, or with
    ``layers`` the residual stream entering each, concatenated ``[T, L * H]`` (what a heads'
    proposer reads: ``getattr(heads, "feature_layers", None)``)."""
    out = model.get_decoder()(input_ids=ids[None], output_hidden_states=layers is not None)
    if layers is None:
        return out.last_hidden_state[0]
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def persist_compiled(path: Path) -> None:
    """Keep inductor's compiled kernels in ``path`` (beside the cached models, not in /tmp),
    so a second process reuses them instead of compiling again. Importing ``torch._dynamo``
    (transformers does) already set ``TORCHINDUCTOR_CACHE_DIR`` to torch's default, which is
    replaced; a folder the user chose is kept. Inductor reads the variable at each use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def mark_capacity_dynamic(cache: Cache, mask: torch.Tensor | dict[str, torch.Tensor]) -> None:
    """Let a compiled pass take any static-cache capacity: the slot dimension of every layer's
    keys and values and the mask's key dimension become symbolic, so one graph per pass size
    serves every capacity (a regrown cache, a longer prompt) instead of one per (size,
    capacity). Measured on the CPU: passes cost the same as with the capacity baked in."""
    import torch._dynamo

    for layer in cache.layers:
        if layer.is_initialized:
            torch._dynamo.mark_dynamic(layer.keys, 2)
            torch._dynamo.mark_dynamic(layer.values, 2)
    for m in (mask.values() if isinstance(mask, dict) else (mask,)):
        torch._dynamo.mark_dynamic(m, m.dim() - 1)


def compiled_forward(device: torch.device, compile: bool | str = True, options: dict | None = None):
    """:func:`forward` through ``torch.compile`` (``compile``: True for inductor, with CUDA
    graphs on CUDA, or another backend's name; ``options``: inductor's, :func:`compile_options`),
    for static caches. Shapes are static: each new-token count compiles once. On CUDA the outputs live in the graph's memory until its
    next replay, so callers that keep them clone them."""
    import torch._dynamo

    # one graph per pass bucket (the capacity is symbolic: mark_capacity_dynamic), and up to
    # 64 of them, more than dynamo's default of 8 (past it, new shapes silently run eager)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    backend = compile if isinstance(compile, str) else "inductor"
    if backend == "inductor" and torch.device(device).type == "cuda":
        return torch.compile(forward, backend=backend, mode="reduce-overhead", dynamic=False)
    if options and backend == "inductor":  # the CPU's (compile_options)
        return torch.compile(forward, backend=backend, options=options, dynamic=False)
    return torch.compile(forward, backend=backend, dynamic=False)


def compile_options(model: PreTrainedModel) -> dict:
    """Inductor's settings for ``model``'s compiled passes: stacked linear products merged
    (kernels.MergeStacked); in half precision emulated precision casts too, so a fused chain
    of elementwise ops rounds to the model's dtype after each op as eager does (with attention,
    the norms' reduction and the rotary embedding as opaque ops, a compiled bfloat16 pass was
    bit-identical to eager: docs/compile.md#compiled-exact-passes)."""
    from medusa.runtime.kernels import MergeStacked

    options = {"post_grad_custom_pre_pass": MergeStacked()}
    if model.dtype in (torch.bfloat16, torch.float16):
        options["emulate_precision_casts"] = True
    return options

