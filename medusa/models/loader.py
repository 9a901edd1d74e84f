"""Loading heads of every kind (Medusa, EAGLE, EAGLE-3, block) from a folder (this repo's layout or a
published one) or a state dict, checked and bound to their target, and fresh Medusa heads sized for a target."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from medusa.errors import MedusaError
from medusa.models import published
from medusa.models.heads import MedusaHeads
from medusa.models.heads_config import (
    CALIBRATION_NAME,
    REFETCH,
    WEIGHTS_NAME,
    HeadsConfig,
    base_model_name,
    read_heads_config,
)
from medusa.models.kinds import kind
from medusa.runtime.files import read_json, read_tensors
from medusa.runtime.ngrams import NGRAMS_NAME, NgramTable


def init_heads_for(model: nn.Module, num_heads: int = 4, num_layers: int = 1, projection: str = "shared") -> MedusaHeads:
    """Fresh heads sized for ``model`` (a Hugging Face causal LM)."""
    lm_head = model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers,
                         projection=projection, base_model=base_model_name(model))
    heads = MedusaHeads(config, lm_head=lm_head)
    return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)


def read_folder(folder: str | Path, model: nn.Module | None = None) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """Config and state dict (this repo's names) of a heads folder: this repo's layout or a
    published one (speculators, SafeAILab, vLLM's Medusa: :mod:`medusa.models.published`).
    ``model`` (the target) is needed by layouts that leave the target's layers implicit."""
    folder = Path(folder)
    layout = published.detect(folder)
    if layout is not None:
        return published.read_published(folder, layout, model)
    if not (folder / WEIGHTS_NAME).is_file():
        published.refuse_pickles(folder)  # one line for a folder of pickled weights
    config = read_heads_config(folder)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise MedusaError(f"{folder} has no {WEIGHTS_NAME}: pass a complete heads folder")
    return config, read_tensors(weights, REFETCH)


def load_heads(folder: str | Path, model: nn.Module | None = None, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """Load heads of any kind and layout from a folder and, when ``model`` is given, check and bind them to it."""
    folder = Path(folder)
    config, state = read_folder(folder, model)
    where = folder / WEIGHTS_NAME if (folder / WEIGHTS_NAME).is_file() else folder
    return apply_calibration(heads_from_state(config, state, model, device, dtype, where=where), folder)


def heads_from_state(config: HeadsConfig, state: dict[str, torch.Tensor], model: nn.Module | None = None,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                     where: str | Path = "the heads") -> nn.Module:
    """Heads of ``config.kind`` from a state dict, checked (names and shapes, one-line errors)
    and, when ``model`` is given, bound to it: the one place every loader builds heads."""
    lm_head = model.get_output_embeddings() if model is not None else None
    if lm_head is not None:
        vocab, hidden = lm_head.weight.shape
        if (hidden, vocab) != (config.hidden_size, config.vocab_size):
            raise MedusaError(
                f"heads in {where} were made for hidden size {config.hidden_size} and vocab {config.vocab_size} "
                f"({config.base_model or 'unknown base'}), but the target has hidden size {hidden} and vocab {vocab}: "
                "use heads trained for this model"
            )
    facts = kind(config.kind)
    build = facts.heads_class()  # the class the registry names for this kind
    if facts.on_target:
        if model is None:
            raise MedusaError(f"{where} holds {config.kind} heads, which are built on their target: pass the target model")
        heads: nn.Module = build(config, model)
        check_state(config, heads.state_dict(), state, where)
    else:
        with torch.device("meta"):  # shapes only: no memory for per-head [V, H] projections
            check_state(config, build(config).state_dict(), state, where)
        heads = build(config)
    if lm_head is not None:
        if not facts.on_target:  # heads apart from their target share its lm_head
            heads.bind(lm_head)
        device = device or lm_head.weight.device
        dtype = dtype or lm_head.weight.dtype
    heads.load_state_dict(state, strict=True)
    return heads.to(device=device, dtype=dtype)


def check_state(config: HeadsConfig, expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                where: str | Path) -> None:
    """Raise unless ``state`` has exactly the tensors (names and shapes) of ``expected``."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise MedusaError(f"{where} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    wrong = [k for k, v in expected.items() if tuple(state[k].shape) != tuple(v.shape)]
    if wrong:
        k = wrong[0]
        raise MedusaError(f"{where}: {k} has shape {tuple(state[k].shape)}, its {config.kind} config implies "
                          f"{tuple(expected[k].shape)}")


def apply_calibration(heads: nn.Module, folder: str | Path) -> nn.Module:
    """Take the calibrated trees, draft vocabulary and n-gram table of a heads folder, if it has them."""
    table = Path(folder) / NGRAMS_NAME
    heads.ngrams = NgramTable.load(table, heads.config.vocab_size) if table.is_file() else None
    calibration = Path(folder) / CALIBRATION_NAME
    if calibration.is_file():
        record = read_json(calibration, "run scripts/calibrate_tree.py again, or delete it (the heads work without it)")
        try:
            _take_calibration(heads, record)
        except (AttributeError, TypeError, ValueError) as err:  # the right JSON, the wrong shapes inside
            raise MedusaError(f"{calibration} does not hold calibrated trees ({str(err)[:120]}): run "
                              "scripts/calibrate_tree.py again, or delete it (the heads work without it)") from None
    return heads


def _take_calibration(heads: nn.Module, record: dict) -> None:
    if hasattr(heads, "trees"):
        heads.trees = {dev: [tuple(p) for p in paths] for dev, paths in record.get("trees", {}).items()}
    if hasattr(heads, "dynamic"):
        heads.dynamic = {dev: dict(size) for dev, size in record.get("dynamic", {}).items()}
    # what calibration measured per device (the pass costs, the drawn chains' curves), any kind
    heads.measured = {dev: entry for dev, entry in record.get("measured", {}).items() if isinstance(entry, dict)}
    if record.get("draft_vocab"):
        heads.set_draft_vocab(record["draft_vocab"])
