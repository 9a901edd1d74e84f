"""A heads folder's format, for heads of every kind: ``config.json`` (:class:`HeadsConfig`)
and ``model.safetensors``, written atomically; nothing is pickled. ``calibration.json`` and
the n-gram table sit beside them (read by :mod:`medusa.models.loader`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from medusa.errors import MedusaError
from medusa.models.kinds import KIND_FIELDS, KINDS, kind, kinds_where  # noqa: F401 (KINDS, KIND_FIELDS: kept for importers)
from medusa.models.target import DEFAULT_MODEL_ID, DEFAULT_MODEL_NAME
from medusa.runtime.files import atomic_folder, read_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Written by scripts/calibrate_tree.py: per-device trees and the draft vocabulary.
CALIBRATION_NAME = "calibration.json"
# What to do about a heads folder with a damaged or missing member (a copy that was cut off).
REFETCH = "download or copy the heads folder again (or export it again where it was trained), or pass another folder"
MODEL_TYPE = "medusa_heads"
PROJECTIONS = ("shared", "per_head")
# The kinds and their facts: medusa.models.kinds (these names are kept for their importers).
FUSED_KINDS = kinds_where("fused")  # heads over several target layers fused, with their own draft vocabulary
EAGLE_KINDS = kinds_where("dynamic_tree")  # heads that draft autoregressively, growing a dynamic tree per step
# How an eagle head's decoder layer sits between fusion and vocabulary (medusa.models.eagle_heads):
# "norms" (the layer's own input norm, then the target's final norm: folders written before
# layouts existed) or "eagle1" (neither: vLLM's EAGLE-1 Llama drafter, so it exports to vLLM).
EAGLE_LAYOUTS = ("norms", "eagle1")


@dataclass
class HeadsConfig:
    """Everything needed to rebuild the heads and check they fit a target."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    projection: str = "shared"
    base_model: str | None = None
    kind: str = "medusa"  # folders written before kinds existed are Medusa heads
    eagle_layout: str = "norms"  # eagle heads only; folders written before layouts existed are "norms"
    feature_layers: list[int] | None = None  # eagle3, block: the target layers whose inputs are fused
    draft_vocab_size: int | None = None  # eagle3, block: rows of the head's own lm_head
    # eagle3 only: the residual around the draft layer's attention adds the feature after
    # hidden_norm (True) or as it entered (False: this repo's heads, SafeAILab's EAGLE-3).
    norm_before_residual: bool = False
    # eagle3 only: the draft layer's own widths and rotary settings where they are not the
    # target's ({"intermediate_size": ..., "rope_parameters": {...}}; None: the target's).
    draft_layer: dict[str, Any] | None = None
    fc_bias: bool = False  # eagle only: the fusion fc has a bias (SafeAILab's EAGLE-1/2 layout)
    # Free-form provenance: training arguments, per-head eval accuracy, LoRA target, ...
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        facts = kind(self.kind)  # one line naming the known kinds for an unknown one
        if self.eagle_layout not in EAGLE_LAYOUTS:
            raise MedusaError(f"unknown eagle layout {self.eagle_layout!r}: use one of {', '.join(EAGLE_LAYOUTS)}")
        if self.projection not in PROJECTIONS:
            raise MedusaError(f"unknown head projection {self.projection!r}: use one of {', '.join(PROJECTIONS)}")
        if facts.fused:
            if not self.feature_layers or len(self.feature_layers) < 2 or not self.draft_vocab_size:
                raise MedusaError(f"{self.kind} heads need feature_layers (two or more target layers) and a draft_vocab_size: "
                                  f"write the folder with train/train_heads.py --kind {self.kind}")
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise MedusaError(f"{self.kind} draft_vocab_size {self.draft_vocab_size} must lie in [1, {self.vocab_size}]")
        if facts.layers is not None and self.num_layers not in facts.layers:
            raise MedusaError(f"{self.kind} heads have {' or '.join(map(str, facts.layers))} decoder layers, "
                              f"got num_layers {self.num_layers}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise MedusaError(f"heads need num_heads >= 1 and num_layers >= 0, got {self.num_heads} and {self.num_layers}")

    def to_dict(self) -> dict[str, Any]:
        data = {"model_type": MODEL_TYPE, **asdict(self)}
        own = kind(self.kind).own_fields  # other kinds' fields are dropped: Medusa folders stay as they were
        for name in KIND_FIELDS:
            if name not in own:
                del data[name]
        if not self.fc_bias:
            data.pop("fc_bias", None)  # eagle folders written before the flag stay as they were
        if self.draft_layer is None:
            data.pop("draft_layer", None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadsConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def checked_draft_vocab(ids: torch.Tensor | list[int] | None, vocab_size: int,
                        device: torch.device | None = None) -> torch.Tensor | None:
    """A draft vocabulary as sorted unique ids, checked against ``vocab_size`` (None: none), on
    ``device`` (the projection's, so that it indexes that projection's top-k where it lives)."""
    if ids is None:
        return None
    ids = torch.as_tensor(ids, dtype=torch.long).unique()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise MedusaError(f"draft vocabulary ids must lie in [0, {vocab_size}): regenerate it for this model")
    return ids if device is None else ids.to(device)


def base_model_name(model: nn.Module) -> str | None:
    """The name heads record as their base: the model's ``name_or_path``, with the embedded
    default's cache folder replaced by its Hub id (a path on one machine means nothing on another)."""
    base = getattr(model.config, "name_or_path", None)
    if base and Path(base).name == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_ID
    return base or None


def save_heads(heads: nn.Module, folder: str | Path) -> Path:
    """Weights + config into ``folder``, atomically; other files it had (model card, eval
    records) are kept."""
    with atomic_folder(folder, keep_other_files=True) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(heads.config.to_dict(), indent=2) + "\n")
    return Path(folder)


def read_heads_config(folder: str | Path) -> HeadsConfig:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise MedusaError(f"{folder} is not a heads folder (no {CONFIG_NAME}): pass a folder written by train/train_heads.py")
    data = read_json(path, REFETCH)
    if data.get("model_type") != MODEL_TYPE:
        raise MedusaError(f"{path} is not a medusa heads config (model_type={data.get('model_type')!r}): "
                          "pass a folder written by train/train_heads.py")
    try:
        return HeadsConfig.from_dict(data)
    except (TypeError, ValueError) as err:  # a required field missing, a number that is not one
        raise MedusaError(f"{path} is damaged ({str(err)[:160]}): {REFETCH}") from None
