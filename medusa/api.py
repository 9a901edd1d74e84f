"""``medusa.load``: the one call benchmarks, the chat and users start from."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from medusa.engine import Engine
from medusa.heads import MedusaHeads, init_heads_for, load_heads
from medusa.hub import load_heads_from
from medusa.target import load_target

# Heads shipped with the repo for the embedded default model.
SHIPPED_HEADS = Path(__file__).resolve().parent / "assets" / "heads" / "smollm2-135m-instruct"


def resolve_heads(heads: str | MedusaHeads | None, model_arg: str | None, model: torch.nn.Module) -> MedusaHeads | None:
    """``None``: the shipped heads when the target is the embedded default (else no heads);
    ``"init"``: fresh, untrained heads for this target; a folder (ours or FasterDecoding's
    Medusa-1 layout) or a Hub id ``USER/NAME``: heads saved there (see :mod:`medusa.hub`)."""
    if isinstance(heads, MedusaHeads):
        return heads.bind(model.get_output_embeddings()) if heads.config.projection == "shared" else heads
    if heads is None:
        if model_arg is None and (SHIPPED_HEADS / "config.json").is_file():
            return load_heads(SHIPPED_HEADS, model)
        return None
    if heads == "init":
        return init_heads_for(model)
    return load_heads_from(heads, model)


def load(
    model: str | None = None,
    heads: str | MedusaHeads | None = None,
    draft: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    tree: str | Sequence[Sequence[int]] | None = None,
    trust_remote_code: bool = False,
) -> Engine:
    """Load a target (``None``: the embedded default), its heads, and return an :class:`Engine`."""
    lm, tokenizer = load_target(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    return Engine(lm, tokenizer, heads=resolve_heads(heads, model, lm), tree=tree)
