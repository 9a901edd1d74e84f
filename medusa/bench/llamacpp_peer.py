"""llama.cpp as a peer in ``infer.bench``: modes ``llamacpp`` and ``llamacpp-lookup``.

Each mode decodes through one long-lived llama-cpp-python worker
(``medusa.peers.llamacpp_client``, in its own venv, built on first use: about 7 minutes on 2
cores; ``MEDUSA_LLAMACPP_PYTHON`` names an existing install instead), started by the bench's
warm-up and reused for every prompt, so the model load stays out of the timing. It reads the
target's weights as an F32 GGUF file (``medusa.peers.gguf_f32``: the same dequantised values
transformers computes with), runs as many threads as torch does here, and decodes the bench's
own prompt token ids one prompt at a time, greedy, up to the same max tokens, stopping after
an end-of-sequence token as ``hf`` does; the worker times the generation alone.

- ``llamacpp``: plain decoding.
- ``llamacpp-lookup``: llama-cpp-python's ``LlamaPromptLookupDecoding`` as the draft, with the
  bench's ``--lookup-tokens`` (tokens drafted per pass) and ``--lookup-ngram`` (longest n-gram
  matched). Its steps are the target passes the worker counted (``Llama.eval`` calls).
"""

from __future__ import annotations

import argparse
import atexit
from collections.abc import Callable
from typing import Any

from medusa.decoding.proposers.factory import LOOKUP_TOKENS
from medusa.errors import MedusaError

MODES = ("llamacpp", "llamacpp-lookup")
WORKERS: dict[str, Any] = {}  # mode -> LlamaCppWorker, for the whole run


def worker(name: str, args: argparse.Namespace, max_new_tokens: int, prompt_tokens: int = 0):
    """The mode's worker, started on first use (the bench's warm-up), and started again with a
    larger context when a prompt does not fit the one it has."""
    lookup = None
    if name == "llamacpp-lookup":
        lookup = {"tokens": args.lookup_tokens or LOOKUP_TOKENS, "ngram": args.lookup_ngram}
    # the prompt, the answer, and the drafts a last verification can run past the answer's end
    need = prompt_tokens + max(max_new_tokens, args.max_new_tokens) + (lookup or {}).get("tokens", 0) + 1
    if name in WORKERS and WORKERS[name].n_ctx < need:
        WORKERS.pop(name).close()
    if name not in WORKERS:
        import torch

        from medusa.peers.gguf_f32 import f32_gguf
        from medusa.peers.llamacpp_client import LlamaCppWorker

        if args.dtype not in (None, "float32", "fp32"):
            raise MedusaError(f"the llamacpp modes decode in float32 (an F32 GGUF); drop --dtype {args.dtype} "
                              "or the llamacpp modes")
        # Room for MT-Bench's longest prompt at least; longer prompts grow it in steps of 512.
        n_ctx = max(1024 + need - prompt_tokens, -(-need // 512) * 512)
        WORKERS[name] = LlamaCppWorker(f32_gguf(args.model), torch.get_num_threads(), lookup, n_ctx=n_ctx)
    return WORKERS[name]


def close_all() -> None:
    for w in WORKERS.values():
        w.close()
    WORKERS.clear()


def register(mode: Callable, run_type: type) -> None:
    """Register the llama.cpp modes with the bench's ``mode`` decorator; ``run_type`` is its ``Run``."""

    def runner(name: str):
        def run(engine, ids: list[int], bench):  # bench: medusa.bench.records.Bench (its args are the CLI's)
            llm = worker(name, bench.args, bench.max_new_tokens, len(ids))
            out = llm.generate(ids, bench.max_new_tokens, sorted(engine.eos))
            # Plain decoding makes one pass per token: as for vllm, its tau reads 1.0.
            return run_type(tokens=out["tokens"], seconds=out["seconds"], steps=out["passes"],
                            first_seconds=out.get("first_seconds"))
        return run

    for name in MODES:
        mode(name)(runner(name))
    atexit.register(close_all)
