"""FasterDecoding/Medusa (Medusa-1) heads checkpoints, read into our layout.

FasterDecoding saves ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and
``base_model_name_or_path``, and the heads' state dict in ``medusa_lm_head.safetensors``
(older releases: a pickled ``medusa_lm_head.pt``, loaded as plain tensors only) with

    {head}.{layer}.linear.weight / .bias          the residual blocks
    {head}.{num_layers}.weight                    each head's own vocabulary projection

Writing that layout is :func:`medusa.hub.export.export_heads` (``layout="fasterdecoding"``).
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import torch

from medusa.errors import MedusaError
from medusa.models.heads_config import CONFIG_NAME, REFETCH, HeadsConfig
from medusa.runtime.files import read_tensors

FD_WEIGHTS = "medusa_lm_head.safetensors"
FD_PICKLE = "medusa_lm_head.pt"
_FD_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FD_PROJ = re.compile(r"^(\d+)\.(\d+)\.weight$")
# Prefixes FasterDecoding-derived checkpoints put before the ModuleList keys.
_FD_PREFIXES = ("medusa_head.", "medusa_heads.")


def is_fasterdecoding_folder(folder: str | Path) -> bool:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):  # cut off or garbage: the heads reader names the file
        return False
    return isinstance(data, dict) and "medusa_num_heads" in data


def load_plain_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A pickled state dict, loaded with ``torch.load(weights_only=True)`` only.

    Anything that is not plain tensors under string keys is refused: unpickling arbitrary
    objects can run code, so a ``.pt`` file that needs more than tensors is not trusted.
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError, EOFError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MedusaError(
            f"refused to load {path}: it is not a plain-tensor checkpoint ({first[:160]}); "
            "only tensors are unpickled (torch.load weights_only=True): convert it to safetensors where it was made"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise MedusaError(f"refused to load {path}: expected a dict of tensors, found {type(state).__name__} with other objects")
    return state


def _strip_prefix(key: str) -> str:
    for prefix in _FD_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def read_fasterdecoding(folder: str | Path) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """Config and state dict, in our layout, of a FasterDecoding Medusa-1 checkpoint folder."""
    folder = Path(folder)
    data = json.loads((folder / CONFIG_NAME).read_text())
    try:
        num_heads, num_layers = int(data["medusa_num_heads"]), int(data.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise MedusaError(f"{folder / CONFIG_NAME} has no integer medusa_num_heads/medusa_num_layers") from None
    if (folder / FD_WEIGHTS).is_file():
        raw = read_tensors(folder / FD_WEIGHTS, REFETCH)
    elif (folder / FD_PICKLE).is_file():
        raw = load_plain_tensors(folder / FD_PICKLE)
    else:
        raise MedusaError(f"{folder} is a FasterDecoding Medusa config without weights: expected {FD_WEIGHTS} or {FD_PICKLE}")
    raw = {_strip_prefix(k): v for k, v in raw.items()}

    state: dict[str, torch.Tensor] = {}
    for head in range(num_heads):
        for layer in range(num_layers):
            for kind in ("weight", "bias"):
                key = f"{head}.{layer}.linear.{kind}"
                if key not in raw:
                    raise MedusaError(f"{folder} does not match its config: {key} is missing for {num_heads} heads x {num_layers} layers")
                state[f"blocks.{head}.{layer}.linear.{kind}"] = raw[key]
        key = f"{head}.{num_layers}.weight"
        if key not in raw:
            raise MedusaError(f"{folder} does not match its config: projection {key} is missing")
        state[f"proj.{head}.weight"] = raw[key]
    # Heads beyond medusa_num_heads (a config trimmed after training) are simply not used;
    # anything that is no head parameter at all means the layout is not what we think.
    unknown = [k for k in raw if not (_FD_BLOCK.match(k) or _FD_PROJ.match(k))]
    if unknown:
        raise MedusaError(f"{folder} has weights that are not Medusa-1 heads ({', '.join(sorted(unknown)[:3])}): not a FasterDecoding heads checkpoint")

    vocab, hidden = state["proj.0.weight"].shape
    config = HeadsConfig(
        hidden_size=int(hidden), vocab_size=int(vocab), num_heads=num_heads, num_layers=num_layers,
        projection="per_head", base_model=data.get("base_model_name_or_path"),
        extra={"imported_from": "FasterDecoding Medusa-1", "source": str(folder)},
    )
    return config, state
