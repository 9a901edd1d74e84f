"""Draft models for classic speculative decoding: loading, checking, and the default draft.

A draft is any Hugging Face causal LM that shares the target's tokenizer. For the
embedded default target no smaller sibling can be downloaded, so the default draft is
made from the target itself: its first few decoder layers, its final norm and its tied
vocabulary projection, saved as an ordinary model of the same architecture with fewer
layers (``shallow_draft``), then distilled towards the target by ``train/train_draft.py``
into ``default_draft_dir()``. Until that has been run, ``draft="default"`` uses the
undistilled shallow copy, built on the fly, and warns.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from medusa.errors import MedusaError
from medusa.models.target import DEFAULT_MODEL_NAME, load_target
from medusa.runtime.files import cache_root

# Layers kept by the default shallow draft. A draft token costs its layers plus the target's
# whole vocabulary projection, itself a fair share of a one-token target pass, so a few
# layers keep it at a fraction of a target pass (docs/training.md#the-default-draft).
DEFAULT_DRAFT_LAYERS = 4
DEFAULT_DRAFT_NAME = f"{DEFAULT_MODEL_NAME}-draft"
_LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")


def default_draft_dir() -> Path:
    """Where ``train/train_draft.py`` saves the distilled draft of the embedded default."""
    return cache_root() / "models" / DEFAULT_DRAFT_NAME


def shallow_draft(target: PreTrainedModel, num_layers: int = DEFAULT_DRAFT_LAYERS) -> PreTrainedModel:
    """A copy of ``target`` keeping only its first ``num_layers`` decoder layers.

    Embeddings, final norm and output projection are copied as they are, so the draft
    starts as the target's own early-exit predictor and needs no new parameters. The
    result is a normal model of the target's architecture (``save_pretrained`` works).
    """
    total = target.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise MedusaError(f"a shallow draft needs 1 to {total} layers (the target has {total}), got {num_layers}")
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    keep = {}
    for name, tensor in target.state_dict().items():
        m = _LAYER_KEY.search(name)
        if m is None or int(m.group(2)) < num_layers:
            keep[name] = tensor
    missing, unexpected = draft.load_state_dict(keep, strict=False)
    # Tied output weights appear under both names in the target but only one is a parameter.
    missing = [k for k in missing if k not in keep and not _is_tied(draft, k)]
    if missing or unexpected:
        raise MedusaError(f"cannot build a shallow draft of {type(target).__name__}: "
                          f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    draft.generation_config = target.generation_config
    return draft.to(target.device).eval().requires_grad_(False)


def _is_tied(model: PreTrainedModel, key: str) -> bool:
    out = model.get_output_embeddings()
    return out is not None and key.endswith("lm_head.weight") and out.weight is model.get_input_embeddings().weight


def check_compatible(
    target: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase | None,
    draft: PreTrainedModel,
    draft_tokenizer: PreTrainedTokenizerBase | None,
    target_name: str,
    draft_name: str,
) -> None:
    """Raise a one-line :class:`MedusaError` unless the draft speaks the target's vocabulary.

    Speculative decoding compares token ids, so both tokenizers must map every string to
    the same id and both output layers must score the same number of ids.
    """
    tv = target.get_output_embeddings().weight.shape[0]
    dv = draft.get_output_embeddings().weight.shape[0]
    both = target_tokenizer is not None and draft_tokenizer is not None
    if both and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise MedusaError(
            f"draft {draft_name} has a different tokenizer "
            f"({type(draft_tokenizer).__name__}, {len(draft_tokenizer)} tokens) from target {target_name} "
            f"({type(target_tokenizer).__name__}, {len(target_tokenizer)} tokens): "
            "use a draft that shares the target's tokenizer"
        )
    if tv != dv:
        raise MedusaError(
            f"draft {draft_name} scores {dv} token ids but target {target_name} scores {tv}: "
            "use a draft with the target's vocabulary"
        )


def load_draft(
    spec: str | PreTrainedModel,
    target: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase | None,
    target_name: str,
    embedded_target: bool = False,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The draft named by ``spec``, on the target's device and dtype, checked against it.

    ``spec`` is a loaded model (moved to the target's device, kept in its own dtype: it only
    proposes, and its logits are read in float32), a Hub id, a model folder, a ``.gguf`` file, or
    ``"default"``: for the embedded default target (``embedded_target``) the distilled
    draft when it has been trained (``default_draft_dir()``), otherwise an undistilled
    shallow copy of the target. ``target_name`` names the target in error messages.
    """
    if isinstance(spec, PreTrainedModel):
        check_compatible(target, None, spec, None, target_name, type(spec).__name__)
        return spec.to(device=target.device).eval().requires_grad_(False)
    if spec == "default":
        folder = default_draft_dir()
        if embedded_target and (folder / "config.json").is_file():
            spec = str(folder)
        else:
            layers = min(DEFAULT_DRAFT_LAYERS, target.config.num_hidden_layers)
            warnings.warn(
                f"no distilled draft for {target_name}: using its first {layers} layers undistilled "
                "(run `python -m train.train_draft` to distil one)", stacklevel=3,
            )
            return shallow_draft(target, layers)
    draft, tokenizer = load_target(str(spec), device=target.device, dtype=target.dtype,
                                   trust_remote_code=trust_remote_code)
    check_compatible(target, target_tokenizer, draft, tokenizer, target_name, str(spec))
    return draft
