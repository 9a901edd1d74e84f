"""Other tools' checkpoint layouts, written: vLLM's drafters, the speculators format and FasterDecoding.

Our layout (``medusa/models/heads_config.py``) is ``config.json`` (``model_type: medusa_heads``) plus
``model.safetensors`` with

    blocks.{head}.{layer}.linear.weight / .bias   [H, H] / [H]
    proj.{head}.weight                            [V, H]   (projection="per_head" only)

FasterDecoding/Medusa (Medusa-1)'s layout is described (and read) in :mod:`medusa.hub.fasterdecoding`;
the speculators format's configs are built in :mod:`medusa.hub.speculators`.

vLLM's Medusa drafter (``model_type: medusa``, ``vllm/model_executor/models/medusa.py``)
reads ``model.safetensors`` with

    blocks.{head}.layers.{layer}.weight / .bias   (biases only when ``medusa_fc_bias`` is true)
    lm_heads.{head}.weight                        one projection per head, or
    lm_head.weight                                one projection all heads use
                                                  (config ``original_lm_head: true``)

vLLM never reads the target's own ``lm_head`` for Medusa, so shared-projection heads carry
one copy of it, which all heads use (``original_lm_head``): the float32 export of the shipped
SmolLM2-135M heads is 113 MiB instead of 437 MiB with a copy per head. FasterDecoding's
layout has no such switch: it gets a copy per head. vLLM can also draft from a subset of
the vocabulary: a ``token_map`` tensor of token ids, ``truncated_vocab_size`` rows per
projection; the draft vocabulary of a calibrated heads folder maps onto it (and shrinks the
projection to those rows).

EAGLE heads in the ``eagle1`` layout (``medusa.models.eagle_heads``) export to vLLM's EAGLE-1 Llama
drafter (``"method": "eagle"``, ``vllm/model_executor/models/llama_eagle.py``): a Llama
``config.json`` cut to one layer (vLLM wraps it in its ``EAGLEConfig``, which renames the
architecture ``LlamaForCausalLM`` to ``EagleLlamaForCausalLM``) and ``model.safetensors`` with

    fc.weight                                     [H, 2H]  ours with its column halves swapped:
                                                           vLLM fuses cat(embed(x), f), we cat(f, embed(x))
    layers.0.self_attn.{q,k,v,o}_proj.weight      the draft layer (vLLM stacks q/k/v and gate/up itself)
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight      (no input_layernorm: the layout has none)

and no ``embed_tokens`` or ``lm_head``: vLLM then shares the target's (its proposer's
``_maybe_share_embeddings`` / ``_maybe_share_lm_head``), as our heads do, so the export is
the head alone (16 MiB in float32 for SmolLM2-135M). Heads in the ``norms`` layout compute
another function (an input norm on the layer, the target's final norm on its output) and are
refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from medusa.errors import MedusaError
from medusa.hub import speculators
from medusa.hub.fasterdecoding import FD_WEIGHTS
from medusa.models.heads_config import CONFIG_NAME, WEIGHTS_NAME, HeadsConfig
from medusa.models.kinds import kind
from medusa.runtime.files import atomic_folder, refuse_foreign

LAYOUTS = ("speculators", "vllm", "fasterdecoding")
_EXPORT_FILES = {CONFIG_NAME, WEIGHTS_NAME, FD_WEIGHTS}

# vLLM's EAGLE-1 drafters by the target's model_type (EAGLEConfig prefixes the architecture with "Eagle").
EAGLE1_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# -- writing ---------------------------------------------------------------------------------
def target_for(config: HeadsConfig, model: str | None = None) -> str | None:
    """The ``load_target`` argument for the heads' target: ``model`` if given, else the
    base model they record; ``None`` (the embedded default) for heads made for it."""
    from medusa.models.target import DEFAULT_MODEL_ID, DEFAULT_MODEL_NAME

    if model is not None:
        return model
    base = config.base_model
    if base is None or base == DEFAULT_MODEL_ID or Path(base).name == DEFAULT_MODEL_NAME:
        return None
    return base


def target_text_config(config: HeadsConfig, model: str | None = None) -> dict[str, Any]:
    """The heads' target's text config as a dict (loads the model on the CPU)."""
    from medusa.models.target import load_target

    lm, _ = load_target(target_for(config, model), device="cpu")
    text = lm.config.get_text_config()
    return {**text.to_diff_dict(), "model_type": text.model_type}  # what its own config.json holds


def target_lm_head(config: HeadsConfig, model: str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ``[V, H]`` vocabulary projection of the heads' target, loaded on the CPU."""
    from medusa.models.target import load_target

    lm, _ = load_target(target_for(config, model), device="cpu", dtype=dtype)
    return lm.get_output_embeddings().weight.detach()


def projection_weights(config: HeadsConfig, state: dict[str, torch.Tensor],
                       lm_head: torch.Tensor | None) -> list[torch.Tensor]:
    """Each head's ``[V, H]`` vocabulary projection; shared heads get copies of ``lm_head``."""
    if config.projection == "per_head":
        return [state[f"proj.{k}.weight"] for k in range(config.num_heads)]
    if lm_head is None:
        raise MedusaError(
            "these heads share the target's lm_head, which the export must copy: "
            "pass the target model (--model) they were trained for"
        )
    if tuple(lm_head.shape) != (config.vocab_size, config.hidden_size):
        raise MedusaError(
            f"the target's lm_head is {tuple(lm_head.shape)[0]} x {tuple(lm_head.shape)[1]} but the heads need "
            f"{config.vocab_size} x {config.hidden_size}: pass the model the heads were trained for"
        )
    # safetensors stores no shared storage: every head gets its own copy.
    return [lm_head.detach().cpu().clone() for _ in range(config.num_heads)]


def vllm_config(config: HeadsConfig, dtype: torch.dtype | None = None, draft_vocab_size: int | None = None) -> dict[str, Any]:
    """``config.json`` for vLLM's ``MedusaConfig``: every key name holding "num" is one it
    maps to ``num_heads`` / ``num_hidden_layers``, so no other such key is written."""
    out: dict[str, Any] = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": draft_vocab_size or config.vocab_size,
        "medusa_fc_bias": True,  # our residual blocks have biases; vLLM drops them unless told
        # One projection for every head, stored once as lm_head.weight (shared heads).
        "original_lm_head": config.projection == "shared",
    }
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    if config.base_model:
        out["base_model_name_or_path"] = config.base_model
    return out


def vllm_state(config: HeadsConfig, state: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
               token_map: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """vLLM's tensors; with ``token_map`` (``[S]`` token ids) each projection keeps only
    those ``S`` rows, and vLLM scatters the drafted logits back to the full vocabulary."""
    out = {}
    for k in range(config.num_heads):
        for j in range(config.num_layers):
            out[f"blocks.{k}.layers.{j}.weight"] = state[f"blocks.{k}.{j}.linear.weight"]
            out[f"blocks.{k}.layers.{j}.bias"] = state[f"blocks.{k}.{j}.linear.bias"]
    if config.projection == "shared":
        # vLLM's original_lm_head: one [V or S, H] projection for all heads.
        w = projection_weights(dataclasses.replace(config, num_heads=1), state, lm_head)[0]
        out["lm_head.weight"] = w if token_map is None else w[token_map]
    else:
        for k, w in enumerate(projection_weights(config, state, lm_head)):
            out[f"lm_heads.{k}.weight"] = w if token_map is None else w[token_map]  # [V or S, H]
    if token_map is not None:
        out["token_map"] = token_map
    return out


def fasterdecoding_config(config: HeadsConfig) -> dict[str, Any]:
    return {
        "medusa_num_heads": config.num_heads,
        "medusa_num_layers": config.num_layers,
        "base_model_name_or_path": config.base_model,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


def fasterdecoding_state(config: HeadsConfig, state: dict[str, torch.Tensor],
                         lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out = {}
    for k in range(config.num_heads):
        for j in range(config.num_layers):
            out[f"{k}.{j}.linear.weight"] = state[f"blocks.{k}.{j}.linear.weight"]
            out[f"{k}.{j}.linear.bias"] = state[f"blocks.{k}.{j}.linear.bias"]
    for k, w in enumerate(projection_weights(config, state, lm_head)):
        out[f"{k}.{config.num_layers}.weight"] = w
    return out


def check_eagle_exportable(config: HeadsConfig, layout: str) -> None:
    """One-line errors for eagle heads that have no export to ``layout``."""
    if layout != "vllm":
        raise MedusaError(f"eagle heads have no {layout} export: FasterDecoding's layout holds Medusa heads only")
    if config.eagle_layout != "eagle1":
        raise MedusaError(
            f"eagle heads in the {config.eagle_layout} layout have no vllm export: vLLM's EAGLE-1 drafter has no "
            "input norm on its layer and no final norm, so these weights would draft differently there; "
            "train with eagle_layout: eagle1 (configs/train/smollm2-135m-eagle1-5k.yaml) to serve with vLLM")


def vllm_eagle_config(config: HeadsConfig, target_config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of an EAGLE-1 draft: the target's own (text) config cut to one layer."""
    model_type = target_config.get("model_type")
    if model_type not in EAGLE1_ARCHITECTURES:
        raise MedusaError(f"vLLM's EAGLE-1 drafter exported here is Llama's, but the target is {model_type!r}: "
                          "serve these heads with this project's engine (mode eagle)")
    if (target_config.get("hidden_size"), target_config.get("vocab_size")) != (config.hidden_size, config.vocab_size):
        raise MedusaError(f"the target has hidden size {target_config.get('hidden_size')} and vocab "
                          f"{target_config.get('vocab_size')} but the heads need {config.hidden_size} and "
                          f"{config.vocab_size}: pass the model the heads were trained for (--model)")
    drop = {"_name_or_path", "_model_name_or_path", "name_or_path", "layer_types", "torch_dtype", "dtype",
            "transformers_version", "architectures", "num_hidden_layers"}
    out = {k: v for k, v in target_config.items() if k not in drop}
    out.update(architectures=[EAGLE1_ARCHITECTURES[model_type]], num_hidden_layers=1,
               dtype=str(dtype).removeprefix("torch."))
    if config.base_model:
        out["base_model_name_or_path"] = config.base_model
    return out


def vllm_eagle_state(config: HeadsConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's EAGLE-1 tensor names; ``fc``'s halves swapped to its cat(embed(x), f) order."""
    h = config.hidden_size
    fc = state["fc.weight"]  # [H, 2H]: columns [:H] read f_p, [H:] read embed(x_{p+1})
    out = {"fc.weight": torch.cat([fc[:, h:], fc[:, :h]], dim=1)}
    for name, tensor in state.items():
        if name.startswith("layer."):
            out["layers.0." + name.removeprefix("layer.")] = tensor
    foreign = sorted(k for k in state if k != "fc.weight" and not k.startswith("layer.")) + \
        [k for k in out if k.endswith("input_layernorm.weight")]
    if foreign:
        raise MedusaError(f"these heads hold {', '.join(foreign[:3])}, which the eagle1 layout has not: "
                          "export an eagle1 heads folder as written by train/train_heads.py")
    return out


def vllm_eagle3_config(config: HeadsConfig, target_config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of vLLM's EAGLE-3 Llama drafter (``LlamaForCausalLMEagle3``) for
    ``eagle3`` heads: the one-layer Llama config the heads were built from
    (:func:`medusa.models.eagle3_heads.drafter_config`), their draft vocabulary size and the
    target layers vLLM hands them (``eagle_aux_hidden_state_layer_ids``: the input of layer
    ``i``, as :func:`medusa.runtime.hf.forward` reads it)."""
    if (target_config.get("hidden_size"), target_config.get("vocab_size")) != (config.hidden_size, config.vocab_size):
        raise MedusaError(f"the target has hidden size {target_config.get('hidden_size')} and vocab "
                          f"{target_config.get('vocab_size')} but the heads need {config.hidden_size} and "
                          f"{config.vocab_size}: pass the model the heads were trained for (--model)")
    from transformers import AutoConfig

    from medusa.models.eagle3_heads import drafter_config

    class _Target:  # drafter_config reads a model's config.get_text_config()
        config = AutoConfig.for_model(**target_config)

    llama = drafter_config(_Target, config.draft_vocab_size, config.draft_layer).to_dict()
    rope = llama.get("rope_parameters") or {}
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias", "mlp_bias", "rope_parameters")
    out = {k: llama[k] for k in keep if k in llama}
    layers = list(config.feature_layers)
    out.update(model_type="llama", architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               rope_theta=rope.get("rope_theta", 10000.0), rope_scaling=_rope_scaling(rope), tie_word_embeddings=False,
               draft_vocab_size=config.draft_vocab_size, target_hidden_size=config.hidden_size,
               norm_before_residual=config.norm_before_residual,  # written always: readers' defaults differ
               eagle_aux_hidden_state_layer_ids=layers,
               eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
               dtype=str(dtype).removeprefix("torch."))
    if config.base_model:
        out["base_model_name_or_path"] = config.base_model
    return out


def vllm_eagle3_state(config: HeadsConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The heads' tensors under vLLM's EAGLE-3 names, which are theirs; ``d2t`` only where the
    draft vocabulary is smaller than the target's (vLLM then maps draft ids through it)."""
    out = dict(state)
    if config.draft_vocab_size == config.vocab_size and not bool(out["d2t"].any()):
        del out["d2t"]
    return out


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_scaling`` as configs before ``rope_parameters`` spell it (None: plain rotary)."""
    if rope.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


def check_three_layers(config: HeadsConfig) -> None:
    """vLLM's EAGLE-3 drafter fuses exactly three target layers (``fc`` reads ``3 * H``)."""
    if len(config.feature_layers) != 3:
        raise MedusaError(f"these eagle3 heads fuse {len(config.feature_layers)} target layers "
                          f"({config.feature_layers}) but vLLM's EAGLE-3 drafter reads three: serve them with this engine")


def check_kind_exportable(config: HeadsConfig) -> None:
    """Block heads have no serving engine's layout to export to: one line saying so, before
    anything (a target) is loaded."""
    if not kind(config.kind).exports:
        raise MedusaError(f"{config.kind} heads have no vLLM or FasterDecoding export (neither serves this layout): "
                          f"decode them with this engine (mode {config.kind}, or hybrid)")


def export_heads(config: HeadsConfig, state: dict[str, torch.Tensor], out: str | Path, layout: str,
                 lm_head: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 draft_vocab: list[int] | torch.Tensor | None = None,
                 target_config: dict[str, Any] | None = None, verifier: dict[str, Any] | None = None) -> Path:
    """Write heads (our config + state dict) to ``out`` in ``layout`` ("speculators", "vllm" or "fasterdecoding").

    ``lm_head`` (``[V, H]``) is the target's vocabulary projection, needed for shared heads.
    ``dtype`` casts every floating tensor (default: keep each tensor's dtype).
    ``draft_vocab`` (vLLM only) makes the heads draft from those token ids alone.
    ``target_config`` (the target's text config as a dict) is needed for eagle1 heads, whose
    vLLM config is the target's cut to one layer. ``verifier`` (speculators only:
    ``{"name_or_path", "architectures"}``) names the target ``vllm serve FOLDER`` loads. The
    folder is written to a temporary sibling and renamed into place.
    """
    if layout not in LAYOUTS:
        raise MedusaError(f"unknown export layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    check_kind_exportable(config)
    writer = _WRITERS[config.kind]  # every kind the registry gives export layouts has one
    if writer is _medusa_export:
        return _medusa_export(config, state, Path(out), layout, lm_head, dtype, draft_vocab, verifier)
    tensors, cfg = writer(config, state, layout, dtype, draft_vocab, target_config, verifier)
    return _write(Path(out), tensors, WEIGHTS_NAME, cfg)


def _eagle3_export(config: HeadsConfig, state: dict[str, torch.Tensor], layout: str, dtype: torch.dtype | None,
                   draft_vocab, target_config: dict[str, Any] | None, verifier: dict[str, Any] | None):
    """EAGLE-3 heads' tensors and config in ``layout`` (speculators' or vLLM's own)."""
    if layout == "fasterdecoding":
        raise MedusaError(f"eagle3 heads have no {layout} export: FasterDecoding's layout holds Medusa heads only")
    if draft_vocab is not None:
        raise MedusaError("eagle3 heads carry their own draft vocabulary (d2t): drop --draft-vocab")
    if target_config is None:
        raise MedusaError("eagle3 heads export with their target's config: pass the target model (--model)")
    check_three_layers(config)
    tensors = _cast(vllm_eagle3_state(config, state), dtype)
    layer = vllm_eagle3_config(config, target_config, tensors["fc.weight"].dtype)
    if layout == "speculators":
        return (_cast(speculators.eagle3_state(config, tensors), None),
                speculators.eagle3_config(config, layer, tensors["fc.weight"].dtype, verifier))
    return tensors, layer


def _eagle_export(config: HeadsConfig, state: dict[str, torch.Tensor], layout: str, dtype: torch.dtype | None,
                  draft_vocab, target_config: dict[str, Any] | None, verifier: dict[str, Any] | None = None):
    """EAGLE-1 heads' tensors and config in vLLM's layout (the only one serving them)."""
    if layout == "speculators":
        raise MedusaError("eagle heads export to vLLM's EAGLE-1 drafter only (the speculators format is written for "
                          "eagle3 and medusa heads): use --to vllm")
    check_eagle_exportable(config, layout)
    if draft_vocab is not None:
        raise MedusaError("vLLM's EAGLE-1 drafter scores the full vocabulary: drop --draft-vocab for eagle heads")
    if target_config is None:
        raise MedusaError("eagle heads export with their target's config: pass the target model (--model)")
    tensors = _cast(vllm_eagle_state(config, state), dtype)
    return tensors, vllm_eagle_config(config, target_config, tensors["fc.weight"].dtype)


def _medusa_export(config: HeadsConfig, state: dict[str, torch.Tensor], out: Path, layout: str,
                   lm_head: torch.Tensor | None, dtype: torch.dtype | None, draft_vocab,
                   verifier: dict[str, Any] | None) -> Path:
    """Medusa heads in ``layout``: speculators', vLLM's (optionally over a draft vocabulary) or
    FasterDecoding's."""
    if layout == "speculators":
        if draft_vocab is not None:
            raise MedusaError("the speculators export of Medusa heads drafts over the full vocabulary: drop --draft-vocab, "
                              "or export --to vllm for a draft vocabulary")
        tensors = _cast(vllm_state(config, state, lm_head), dtype)  # speculators' names are vLLM's
        return _write(out, tensors, WEIGHTS_NAME, speculators.medusa_config(config, _projection_dtype(tensors), verifier))
    token_map = None
    if draft_vocab is not None:
        if layout != "vllm":
            raise MedusaError(f"a draft vocabulary can only be exported to the vllm layout: drop it for {layout}")
        token_map = torch.as_tensor(draft_vocab, dtype=torch.long).unique()  # sorted ids
        if token_map.numel() == 0 or int(token_map.min()) < 0 or int(token_map.max()) >= config.vocab_size:
            raise MedusaError(f"draft vocabulary ids must lie in [0, {config.vocab_size}): recalibrate the heads for this model")
    if layout == "fasterdecoding":
        return _write(out, _cast(fasterdecoding_state(config, state, lm_head), dtype), FD_WEIGHTS,
                      fasterdecoding_config(config))
    tensors = _cast(vllm_state(config, state, lm_head, token_map), dtype)
    cfg = vllm_config(config, _projection_dtype(tensors), None if token_map is None else token_map.numel())
    return _write(out, tensors, WEIGHTS_NAME, cfg)


# one writer per kind with export layouts (medusa.models.kinds: Kind.exports)
_WRITERS = {"medusa": _medusa_export, "eagle": _eagle_export, "eagle3": _eagle3_export}


def _projection_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    return tensors["lm_head.weight" if "lm_head.weight" in tensors else "lm_heads.0.weight"].dtype


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every floating tensor in ``dtype`` (None: as it is), contiguous on the CPU, for saving."""
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in tensors.items()}


def _write(out: Path, tensors: dict[str, torch.Tensor], name: str, cfg: dict[str, Any]) -> Path:
    refuse_foreign(out, _EXPORT_FILES, "--output folder")  # replace an earlier export, nothing else
    with atomic_folder(out) as tmp:
        save_file(tensors, tmp / name, metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    return out
