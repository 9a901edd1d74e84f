"""medusa: model-free speculative decoding on stock Hugging Face causal LMs.

>>> import medusa
>>> eng = medusa.load()                      # embedded default model and its heads
>>> res = eng.generate([1, 2, 3], max_new_tokens=32)
>>> res.tokens, res.stats.tau

The layout follows the architecture, each layer importing only those below it:
``medusa.api`` (``load``) over ``medusa.autotune`` (what this machine measures: dtype,
kernels, tree sizes, tree calibration) over ``medusa.decoding`` (engine, proposers, trees,
acceptance), ``medusa.training`` and ``medusa.hub``, over ``medusa.models`` (heads, their
folders and loader, target, draft) over ``medusa.runtime`` (the one module touching
transformers internals, exact attention, linear kernels, n-gram tables, files). Names below
are imported on first use, so ``import medusa`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load": "medusa.api",
    "Engine": "medusa.decoding.engine",
    "Plan": "medusa.decoding.plan",
    "GenerationResult": "medusa.decoding.engine",
    "GenerationStats": "medusa.decoding.engine",
    "MedusaError": "medusa.errors",
    "HeadsConfig": "medusa.models.heads_config",
    "MedusaHeads": "medusa.models.heads",
    "load_heads": "medusa.models.loader",
    "compile_tree": "medusa.decoding.tree",
    "SamplingConfig": "medusa.decoding.sampling",
    "ProposerConfig": "medusa.decoding.proposers.factory",
    "Conversation": "medusa.conversation",
}

__all__ = ["load", "Engine", "Plan", "GenerationResult", "GenerationStats", "MedusaError", "HeadsConfig", "MedusaHeads",
           "load_heads", "compile_tree", "SamplingConfig", "ProposerConfig", "Conversation"]

if TYPE_CHECKING:
    from medusa.api import load
    from medusa.conversation import Conversation
    from medusa.decoding.engine import Engine, GenerationResult, GenerationStats
    from medusa.decoding.plan import Plan
    from medusa.decoding.proposers.factory import ProposerConfig
    from medusa.decoding.sampling import SamplingConfig
    from medusa.decoding.tree import compile_tree
    from medusa.errors import MedusaError
    from medusa.models.heads import MedusaHeads
    from medusa.models.heads_config import HeadsConfig
    from medusa.models.loader import load_heads


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'medusa' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
