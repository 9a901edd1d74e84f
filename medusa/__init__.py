"""medusa: model-free speculative decoding on stock Hugging Face causal LMs.

>>> import medusa
>>> eng = medusa.load()                      # embedded default model and its heads
>>> res = eng.generate([1, 2, 3], max_new_tokens=32)
>>> res.tokens, res.stats.tau
"""

from medusa.api import load
from medusa.engine import Engine, GenerationResult, GenerationStats
from medusa.errors import MedusaError
from medusa.heads import HeadsConfig, MedusaHeads, load_heads
from medusa.sampling import SamplingConfig
from medusa.tree import compile_tree

__all__ = ["load", "Engine", "GenerationResult", "GenerationStats", "MedusaError", "HeadsConfig", "MedusaHeads",
           "load_heads", "compile_tree", "SamplingConfig"]
