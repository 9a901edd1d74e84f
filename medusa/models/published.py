"""Heads published in other projects' layouts, read into this repo's heads (config + state dict).

Each reader maps a layout's config keys and tensor names onto one of this repo's head kinds
(:mod:`medusa.models.heads_config`); the heads are then ordinary heads objects and run in every
mode. What a layout can hold that no kind here computes is refused in one line, never dropped.

================================  ==========================================  ===================
layout (how it is recognised)     tensors                                     kind here
================================  ==========================================  ===================
speculators ``eagle3``            ``fc``, ``layers.0.*``, ``norm``,           ``eagle3``
(``speculators_model_type``)      ``lm_head``, ``d2t``/``t2d``,
                                  optional ``embed_tokens``
speculators ``medusa``            ``blocks.{k}.layers.{j}``,                  ``medusa``
                                  ``lm_heads.{k}`` or none/``lm_head``
vLLM ``medusa`` (``model_type``)  the same names (this repo's ``--to vllm``)  ``medusa``
SafeAILab EAGLE-3 (``Eagle3`` in  ``fc``, ``midlayer.*`` (or ``layers.0.*``), ``eagle3``
``architectures`` or a            ``norm``, ``lm_head``, ``d2t``/``t2d``
``draft_vocab_size``)
SafeAILab EAGLE-1/2 (a one-layer  ``fc`` (+ ``fc.bias``), ``layers.0.*``,     ``eagle`` (layout
Llama config, ``fc`` + layers)    optional ``embed_tokens``                   ``eagle1``)
================================  ==========================================  ===================

The mappings, key by key:

* EAGLE-3 (both layouts): ``fc`` ``[H, L*H]`` reads the inputs of the target layers
  ``eagle_aux_hidden_state_layer_ids`` (vLLM's meaning: the residual stream entering layer
  ``i``, this repo's ``feature_layers``); SafeAILab's configs name none, so the layers are its
  fixed choice for the target's depth ``n``: ``2, n // 2, n - 3``. ``midlayer.`` is renamed
  ``layers.0.``. ``d2t[i]``: draft id ``i`` is target token ``i + d2t[i]`` (the same in all three
  projects); ``t2d`` (a ``[V]`` mask of the same ids) is checked against it, then dropped.
  ``norm_before_residual`` is read explicitly: when a speculators config lacks the key we take
  **true**, as vLLM does when it serves such a checkpoint (speculators itself writes the key
  always); SafeAILab's layer adds the feature before ``hidden_norm``, i.e. false, which is also
  what vLLM assumes for its ``LlamaForCausalLMEagle3`` configs. The draft layer's own widths and
  rotary settings (``transformer_layer_config``, or the SafeAILab config itself) become
  ``HeadsConfig.draft_layer``. A draft ``embed_tokens`` must equal the target's (this repo's
  heads embed with the target's; vLLM shares it too) and is then dropped.
* Medusa: ``blocks.{k}.layers.{j}.weight/bias`` -> ``blocks.{k}.{j}.linear.weight/bias`` (zero
  biases when ``medusa_fc_bias`` is false: the same function); ``original_lm_head: true`` means
  the target's projection (``projection="shared"``; a stored ``lm_head.weight`` must be the
  target's), else ``lm_heads.{k}.weight`` -> ``proj.{k}.weight`` (``per_head``).
* EAGLE-1/2: ``fc`` reads ``cat(embed(x), f)``, this repo's ``cat(f, embed(x))``: its column
  halves are swapped; ``layers.0.*`` -> ``layer.*`` (no input norm: layout ``eagle1``); a
  ``fc.bias`` sets ``fc_bias``. The draft layer is the target's class, so its widths, norm
  epsilon and rotary base must be the target's.

Only safetensors are read: a folder whose weights are pickled (``pytorch_model.bin``, ``.pt``)
gets one line saying how to convert them. (FasterDecoding's Medusa-1 layout, with its plain-tensor
``.pt``, is read by :mod:`medusa.hub.export`.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medusa.errors import MedusaError
from medusa.models.heads_config import CONFIG_NAME, MODEL_TYPE, REFETCH, HeadsConfig
from medusa.runtime.files import read_tensors

SPECULATORS_EAGLE3 = "speculators eagle3"
SPECULATORS_MEDUSA = "speculators medusa"
VLLM_MEDUSA = "vLLM medusa"
SAFEAILAB_EAGLE3 = "SafeAILab EAGLE-3"
SAFEAILAB_EAGLE = "SafeAILab EAGLE-1/2"
LAYOUTS = (SPECULATORS_EAGLE3, SPECULATORS_MEDUSA, VLLM_MEDUSA, SAFEAILAB_EAGLE3, SAFEAILAB_EAGLE)
# SafeAILab's drafting depth (``EaModel.from_pretrained(depth=7)``): its configs record no step count.
SAFEAILAB_STEPS = 7
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# Keys a draft checkpoint may carry that are not weights of the draft (speculators' frozen
# copies of the verifier's, a rotary cache some old checkpoints saved).
_NOT_WEIGHTS = ("verifier_lm_head.weight", "verifier_norm.weight")


# -- recognising a layout -----------------------------------------------------------------------
def _config_dict(folder: Path) -> dict[str, Any] | None:
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):  # the folder's own reader names the damaged file
        return None
    return data if isinstance(data, dict) else None


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _tensor_names(folder: Path) -> set[str]:
    """Names in the folder's safetensors headers (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        except (SafetensorError, OSError, ValueError):  # read_tensors names it in one line later
            continue
    return names


def detect(folder: str | Path) -> str | None:
    """The published layout of ``folder`` (one of :data:`LAYOUTS`), or None: this repo's own
    folders, FasterDecoding's Medusa-1 (read in :mod:`medusa.hub.export`) and anything else
    fall through to this repo's reader, which names what is missing."""
    folder = Path(folder)
    data = _config_dict(folder)
    if data is None or data.get("model_type") == MODEL_TYPE or "medusa_num_heads" in data:
        return None
    spec_type = data.get("speculators_model_type")  # the speculators format's own names, not a heads kind
    if spec_type is not None:
        if spec_type == "eagle3":
            return SPECULATORS_EAGLE3
        if spec_type == "medusa":
            return SPECULATORS_MEDUSA
        raise MedusaError(f"{folder} holds speculators {spec_type!r} heads, which no heads kind here computes: "
                          "this engine reads speculators eagle3 and medusa checkpoints")
    if data.get("model_type") == "medusa":
        return VLLM_MEDUSA
    names = _tensor_names(folder)
    archs = [str(a) for a in data.get("architectures") or []]
    if any("midlayer." in n or n.endswith("hidden_norm.weight") for n in names) or any("Eagle3" in a for a in archs) \
            or ("draft_vocab_size" in data and not names):
        return SAFEAILAB_EAGLE3
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return SAFEAILAB_EAGLE
    if not names and data.get("num_hidden_layers") == 1:
        return SAFEAILAB_EAGLE  # a draft config without safetensors: refused with the conversion line
    return None


def _pickles(folder: Path) -> list[Path]:
    return sorted(p for pattern in PICKLES for p in folder.glob(pattern))


def refuse_pickles(folder: str | Path, layout: str | None = None) -> None:
    """One line for a folder whose weights are pickled only: they are never unpickled here
    (unpickling can run code), so say how to convert them where the file is trusted."""
    folder = Path(folder)
    if _weight_files(folder):
        return
    pickled = _pickles(folder)
    what = f"{layout} heads" if layout else "heads"
    if pickled:
        name = pickled[0].name
        raise MedusaError(
            f"{folder} holds {what} as pickled weights only ({name}), which are never unpickled here: convert "
            f"them once where you trust the file: python -c \"import torch; from safetensors.torch import save_file; "
            f"save_file(torch.load('{name}', weights_only=True), 'model.safetensors')\"")
    if layout:
        raise MedusaError(f"{folder} has a {layout} config.json but no .safetensors weights (Hub downloads fetch no "
                          f"pickled pytorch_model.bin): convert the weights to model.safetensors, or {REFETCH}")


# -- reading ------------------------------------------------------------------------------------
def read_published(folder: str | Path, layout: str, model: nn.Module | None = None) -> tuple[HeadsConfig, dict]:
    """Config and state dict, in this repo's names, of a ``layout`` folder. ``model`` (the
    target) is needed where the layout leaves something to the target (SafeAILab's EAGLE-3
    layers) and lets what the heads share with it (embeddings, ``lm_head``) be checked."""
    folder = Path(folder)
    refuse_pickles(folder, layout)
    data = _config_dict(folder)
    if data is None:
        raise MedusaError(f"{folder / CONFIG_NAME} is damaged or not a JSON object: {REFETCH}")
    raw: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        raw.update(read_tensors(path, REFETCH))
    raw = {k: v for k, v in raw.items() if k not in _NOT_WEIGHTS and not k.endswith("rotary_emb.inv_freq")}
    where = f"{folder} ({layout})"
    reader = {SPECULATORS_EAGLE3: _speculators_eagle3, SAFEAILAB_EAGLE3: _safeailab_eagle3,
              SPECULATORS_MEDUSA: _medusa, VLLM_MEDUSA: _medusa, SAFEAILAB_EAGLE: _safeailab_eagle}[layout]
    config, state = reader(data, raw, model, where, layout)
    config.extra = {"imported_from": layout, "source": str(folder)}
    return config, state


def _int(data: dict, key: str, where: str, default: Any = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MedusaError(f"{where}: config key {key!r} is {value!r}, not an integer: {REFETCH}")
    return value


def _flag(data: dict, key: str, default: bool) -> bool:
    value = data.get(key, default)
    return default if value is None else bool(value)


def _rope(cfg: dict) -> dict[str, Any]:
    """The rotary settings of a Llama-style config as transformers' ``rope_parameters``: newer
    configs hold them so, older ones as ``rope_theta`` plus ``rope_scaling``."""
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        rope = rope["full_attention"]
    if isinstance(rope, dict) and rope.get("rope_type"):
        return dict(rope)
    theta = float(cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        out = {k: v for k, v in scaling.items() if k != "type"}
        out["rope_type"] = scaling.get("rope_type") or scaling["type"]
        out["rope_theta"] = theta
        return out
    return {"rope_type": "default", "rope_theta": theta}


def _layer_settings(cfg: dict, hidden: int, where: str) -> dict[str, Any]:
    """The draft layer's shapes and constants (``HeadsConfig.draft_layer``) from a Llama-style config."""
    heads = _int(cfg, "num_attention_heads", where)
    out = {
        "intermediate_size": _int(cfg, "intermediate_size", where),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(cfg.get("rms_norm_eps") or 1e-6),
        "hidden_act": str(cfg.get("hidden_act") or "silu"),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "rope_parameters": _rope(cfg),
    }
    if cfg.get("max_position_embeddings"):  # read by dynamic rotary types only
        out["max_position_embeddings"] = int(cfg["max_position_embeddings"])
    return out


def _target_layers(model: nn.Module | None, where: str) -> int:
    if model is None:
        raise MedusaError(f"{where} names no target layers (eagle_aux_hidden_state_layer_ids): they follow from the "
                          "target's depth, so pass the target model (--model)")
    return model.config.get_text_config().num_hidden_layers


def _shared_with_target(name: str, tensor: torch.Tensor, target: torch.Tensor | None, where: str) -> None:
    """A tensor the heads take from the target instead (embeddings, ``lm_head``) must be the
    target's: compared in the stored dtype, so a float16 copy of float32 weights passes."""
    if target is None:
        return
    if tuple(tensor.shape) != tuple(target.shape):
        raise MedusaError(f"{where}: its {name} is {tuple(tensor.shape)} but the target's is {tuple(target.shape)}: "
                          "use heads trained for this model")
    ours = target.detach().to("cpu", tensor.dtype).float()
    if not torch.allclose(tensor.float(), ours, rtol=1e-2, atol=1e-3):
        raise MedusaError(f"{where}: its {name} differs from the target's, and these heads use the target's: "
                          "use heads trained for this model (or this exact target)")


def _vocab_map(raw: dict, draft: int, vocab: int, where: str) -> torch.Tensor:
    """``[S]`` ``d2t`` checked: ids ``i + d2t[i]`` distinct and inside the target's vocabulary,
    and the ``t2d`` mask, when stored, marking exactly those ids."""
    d2t = raw.pop("d2t", None)
    t2d = raw.pop("t2d", None)
    if d2t is None:
        if draft != vocab:
            raise MedusaError(f"{where}: a draft vocabulary of {draft} of {vocab} tokens but no d2t map: {REFETCH}")
        d2t = torch.zeros(draft, dtype=torch.long)
    d2t = d2t.to(torch.long).reshape(-1)
    if d2t.numel() != draft:
        raise MedusaError(f"{where}: d2t has {d2t.numel()} entries for draft_vocab_size {draft}: {REFETCH}")
    ids = torch.arange(draft) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft:
        raise MedusaError(f"{where}: d2t maps draft ids outside the target's {vocab} tokens or twice onto one: {REFETCH}")
    if t2d is not None:
        t2d = t2d.reshape(-1).bool()
        if t2d.numel() != vocab or int(t2d.sum()) != draft or not bool(t2d[ids].all()):
            raise MedusaError(f"{where}: t2d does not mark the target ids d2t maps to: {REFETCH}")
    return d2t


def _eagle3(raw: dict, model: nn.Module | None, where: str, *, hidden: int, vocab: int, draft: int,
            layer_ids: list[int] | None, norm_before_residual: bool, layer: dict, steps: int,
            base: str | None) -> tuple[HeadsConfig, dict]:
    """What both EAGLE-3 layouts share, once their config keys are read."""
    state = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v for k, v in raw.items()}
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and model is not None:
        _shared_with_target("embed_tokens", embed, model.get_input_embeddings().weight, where)
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[1] % hidden:
        raise MedusaError(f"{where} has no fc.weight reading whole target layers of width {hidden}: {REFETCH}")
    if layer_ids is None:
        n = _target_layers(model, where)
        layer_ids = sorted({2, n // 2, n - 3})  # SafeAILab's and vLLM's choice for an n-layer target
    if fc.shape[1] != len(layer_ids) * hidden:
        raise MedusaError(f"{where}: fc reads {fc.shape[1] // hidden} target layers but the layers are {layer_ids}: "
                          "set eagle_aux_hidden_state_layer_ids in its config.json")
    state["d2t"] = _vocab_map(state, draft, vocab, where)
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=steps, num_layers=1, kind="eagle3",
                         base_model=base, feature_layers=[int(i) for i in layer_ids], draft_vocab_size=draft,
                         norm_before_residual=norm_before_residual, draft_layer=layer)
    return config, state


def _speculators_eagle3(data: dict, raw: dict, model, where: str, layout: str) -> tuple[HeadsConfig, dict]:
    tl = data.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise MedusaError(f"{where} has no transformer_layer_config object: {REFETCH}")
    arch = tl.get("model_type", "llama")
    if arch != "llama":
        raise MedusaError(f"{where} has a {arch} draft layer (its attention normalises q and k), but eagle3 heads "
                          "here run Llama's layer: use a checkpoint with a llama transformer_layer_config")
    if _int(tl, "num_hidden_layers", where, 1) != 1:
        raise MedusaError(f"{where} has {tl['num_hidden_layers']} draft layers, eagle3 heads here have one: "
                          "use a one-layer EAGLE-3 checkpoint")
    for key, what in (("norm_before_fc", "a norm on the fused target layers"),
                      ("fc_norm", "a norm on each target layer before fc"),
                      ("norm_output", "normed outputs fed back between draft steps")):
        if _flag(data, key, False):
            raise MedusaError(f"{where} sets {key} ({what}), which eagle3 heads here do not compute: "
                              "use a checkpoint trained without it")
    hidden, vocab = _int(tl, "hidden_size", where), _int(tl, "vocab_size", where)
    if data.get("target_hidden_size") not in (None, hidden):
        raise MedusaError(f"{where}: the draft is {hidden} wide but its target {data['target_hidden_size']}; eagle3 heads "
                          "here are as wide as their target")
    spec = data.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    steps = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    verifier = spec.get("verifier") or {}
    return _eagle3(raw, model, where, hidden=hidden, vocab=vocab, draft=int(data.get("draft_vocab_size") or vocab),
                   layer_ids=data.get("eagle_aux_hidden_state_layer_ids") or None,
                   # vLLM's default when the key is missing (speculators itself always writes it)
                   norm_before_residual=_flag(data, "norm_before_residual", True),
                   layer=_layer_settings(tl, hidden, where), steps=int(steps or SAFEAILAB_STEPS),
                   base=verifier.get("name_or_path") if isinstance(verifier, dict) else None)


def _safeailab_eagle3(data: dict, raw: dict, model, where: str, layout: str) -> tuple[HeadsConfig, dict]:
    hidden, vocab = _int(data, "hidden_size", where), _int(data, "vocab_size", where)
    if data.get("target_hidden_size") not in (None, hidden):
        raise MedusaError(f"{where}: the draft is {hidden} wide but its target {data['target_hidden_size']}; eagle3 heads "
                          "here are as wide as their target")
    if _int(data, "num_hidden_layers", where, 1) != 1:
        raise MedusaError(f"{where} has {data['num_hidden_layers']} draft layers, eagle3 heads here have one")
    eagle = data.get("eagle_config") if isinstance(data.get("eagle_config"), dict) else {}
    layer_ids = data.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or None
    return _eagle3(raw, model, where, hidden=hidden, vocab=vocab, draft=int(data.get("draft_vocab_size") or vocab),
                   layer_ids=layer_ids, norm_before_residual=_flag(data, "norm_before_residual", False),
                   layer=_layer_settings(data, hidden, where), steps=int(data.get("num_speculative_tokens") or SAFEAILAB_STEPS),
                   base=data.get("base_model_name_or_path"))


def _medusa(data: dict, raw: dict, model, where: str, layout: str) -> tuple[HeadsConfig, dict]:
    spec = layout == SPECULATORS_MEDUSA
    heads = _int(data, "num_heads", where, 5 if spec else None)
    layers = _int(data, "num_hidden_layers", where, 1)
    bias = _flag(data, "medusa_fc_bias", False)
    shared = _flag(data, "original_lm_head", spec)  # speculators' default true, vLLM's false
    first = raw.get("blocks.0.layers.0.weight")
    hidden = data.get("medusa_hidden_size") or data.get("hidden_size") or (first.shape[1] if first is not None else None)
    vocab = data.get("medusa_vocab_size") or data.get("vocab_size")
    if not vocab and model is not None:
        vocab = model.get_output_embeddings().weight.shape[0]
    if not hidden or not vocab:
        raise MedusaError(f"{where} records no hidden or vocabulary size: pass the target model, or {REFETCH}")
    hidden, vocab = int(hidden), int(vocab)
    truncated = int(data.get("truncated_vocab_size") or 0)
    if truncated and truncated != vocab or "token_map" in raw or "d2t" in raw:
        raise MedusaError(f"{where} drafts from a truncated vocabulary ({truncated or '?'} of {vocab} tokens), which "
                          "Medusa heads here do not import: export them over the full vocabulary")
    state: dict[str, torch.Tensor] = {}
    for k in range(heads):
        for j in range(layers):
            w = raw.pop(f"blocks.{k}.layers.{j}.weight", None)
            if w is None:
                raise MedusaError(f"{where} does not match its config: blocks.{k}.layers.{j}.weight is missing for "
                                  f"{heads} heads x {layers} layers")
            b = raw.pop(f"blocks.{k}.layers.{j}.bias", None)
            if b is None and bias:
                raise MedusaError(f"{where} sets medusa_fc_bias but blocks.{k}.layers.{j}.bias is missing: {REFETCH}")
            state[f"blocks.{k}.{j}.linear.weight"] = w
            state[f"blocks.{k}.{j}.linear.bias"] = b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
    if shared:
        lm_head = raw.pop("lm_head.weight", None)  # a copy of the target's, which the heads use instead
        if lm_head is None:
            lm_head = raw.pop("lm_heads.0.weight", None)  # vLLM's spelling of the one projection
        if lm_head is not None and model is not None:
            _shared_with_target("lm_head", lm_head, model.get_output_embeddings().weight, where)
    else:
        for k in range(heads):
            w = raw.pop(f"lm_heads.{k}.weight", None)
            if w is None:
                raise MedusaError(f"{where} does not match its config: lm_heads.{k}.weight is missing "
                                  "(original_lm_head is false: one projection per head)")
            state[f"proj.{k}.weight"] = w
    unknown = sorted(k for k in raw if k != "embed_tokens.weight")  # what is left: no part of these heads
    if unknown:
        raise MedusaError(f"{where} has weights these Medusa heads have not ({', '.join(unknown[:3])}): {REFETCH}")
    verifier = (data.get("speculators_config") or {}).get("verifier") or {}
    base = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=heads, num_layers=layers,
                         projection="shared" if shared else "per_head",
                         base_model=base or data.get("base_model_name_or_path"))
    return config, state


def _safeailab_eagle(data: dict, raw: dict, model, where: str, layout: str) -> tuple[HeadsConfig, dict]:
    hidden = _int(data, "hidden_size", where)
    if _int(data, "num_hidden_layers", where, 1) != 1:
        raise MedusaError(f"{where} has {data['num_hidden_layers']} draft layers, eagle heads here have one")
    if "layers.0.input_layernorm.weight" in raw:
        raise MedusaError(f"{where} normalises the fused input of its draft layer (layers.0.input_layernorm), which "
                          "EAGLE-1's layer does not: not an EAGLE-1/2 checkpoint this engine reads")
    embed = raw.pop("embed_tokens.weight", None)
    if embed is not None and model is not None:
        _shared_with_target("embed_tokens", embed, model.get_input_embeddings().weight, where)
    fc = raw.pop("fc.weight", None)
    if fc is None or tuple(fc.shape) != (hidden, 2 * hidden):
        raise MedusaError(f"{where} has no fc.weight of shape ({hidden}, {2 * hidden}): {REFETCH}")
    # theirs reads cat(embed(x), f), ours cat(f, embed(x)): swap the column halves
    state = {"fc.weight": torch.cat([fc[:, hidden:], fc[:, :hidden]], dim=1)}
    bias = raw.pop("fc.bias", None)
    if bias is not None:
        state["fc.bias"] = bias
    for name, tensor in raw.items():
        if not name.startswith("layers.0."):
            raise MedusaError(f"{where} has weights an EAGLE-1 head has not ({name}): {REFETCH}")
        state["layer." + name.removeprefix("layers.0.")] = tensor
    if model is not None:
        _same_layer_as_target(data, model, where)
    config = HeadsConfig(hidden_size=hidden, vocab_size=_int(data, "vocab_size", where), num_heads=SAFEAILAB_STEPS,
                         num_layers=1, kind="eagle", eagle_layout="eagle1", fc_bias=bias is not None,
                         base_model=data.get("base_model_name_or_path"))
    return config, state


def _same_layer_as_target(data: dict, model: nn.Module, where: str) -> None:
    """An eagle head's layer is built from the target's own config: the draft's must agree."""
    t = model.config.get_text_config()
    t_rope = _rope({"rope_parameters": getattr(t, "rope_parameters", None), "rope_theta": getattr(t, "rope_theta", None),
                    "rope_scaling": getattr(t, "rope_scaling", None)})
    theirs = {"intermediate_size": data.get("intermediate_size"), "num_attention_heads": data.get("num_attention_heads"),
              "num_key_value_heads": data.get("num_key_value_heads") or data.get("num_attention_heads"),
              "rms_norm_eps": data.get("rms_norm_eps"), "rope_theta": _rope(data)["rope_theta"]}
    ours = {"intermediate_size": t.intermediate_size, "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
            "rms_norm_eps": getattr(t, "rms_norm_eps", None), "rope_theta": t_rope["rope_theta"]}
    wrong = [k for k, v in theirs.items() if v is not None and ours[k] is not None and float(v) != float(ours[k])]
    if wrong:
        k = wrong[0]
        raise MedusaError(f"{where}: its draft layer has {k} {theirs[k]} but the target {ours[k]}; eagle heads here "
                          "run a layer of the target's own shape: use heads trained for this model")
