"""vLLM as a peer in ``infer.bench``: modes ``vllm``, ``vllm-ngram``, ``vllm-heads``, ``vllm-eagle`` and ``vllm-eagle3``.

Each mode decodes through one long-lived vLLM worker (``medusa.peers.vllm_client``), started
by the bench's warm-up and reused for every prompt, so the model load stays out of the
timing. Prompts are the bench's own token ids, one at a time (batch size 1), greedy, with
the same max tokens; the worker times ``LLM.generate`` alone.

- ``vllm``: plain decoding.
- ``vllm-ngram``: vLLM's prompt lookup with the bench's ``--lookup-tokens`` and ``--lookup-ngram``.
- ``vllm-heads``: the bench's Medusa heads (``--heads``, default the shipped ones), exported
  with ``scripts/export_heads.py``'s code (full vocabulary): vLLM drafts each head's top-1.
- ``vllm-eagle``: the bench's eagle heads (``--eagle-heads``, or ``--heads`` when those are
  eagle heads; default the shipped ones), in the ``eagle1`` layout, exported the same way:
  vLLM's EAGLE-1 drafter (``"method": "eagle"``) drafts one top-1 chain of ``num_heads`` tokens.
- ``vllm-eagle3``: the bench's eagle3 heads (``--eagle3-heads``, or ``--heads`` when those are
  eagle3 heads; default the shipped ones), as vLLM's EAGLE-3 drafter (``"method": "eagle3"``),
  a top-1 chain of ``num_heads`` tokens over their draft vocabulary.
"""

from __future__ import annotations

import argparse
import atexit
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from medusa.decoding.proposers.factory import LOOKUP_TOKENS
from medusa.errors import MedusaError

WORKERS: dict[str, Any] = {}  # mode -> VLLMWorker, for the whole run
_EXPORTS: list[tempfile.TemporaryDirectory] = []


def speculative_config(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    if name == "vllm":
        return None
    if name == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": args.lookup_tokens or LOOKUP_TOKENS,
                "prompt_lookup_max": args.lookup_ngram, "prompt_lookup_min": 1}
    import torch

    from medusa.api import default_heads
    from medusa.hub.hub import read_heads, resolve_heads_folder
    from medusa.peers.vllm_client import export_for_vllm

    if name in ("vllm-eagle", "vllm-eagle3"):
        kind = name.removeprefix("vllm-")
        heads = getattr(args, f"{kind}_heads")
        if heads is None and args.heads not in (None, "init"):
            heads = args.heads if read_heads(resolve_heads_folder(args.heads))[0].kind == kind else None
        if heads is None:
            heads = default_heads(args.model, torch.device("cpu"), kind)
        if heads is None:
            raise MedusaError(f"mode {name} needs trained {kind} heads: pass --{kind}-heads FOLDER")
    else:
        heads = args.heads or default_heads(args.model, torch.device("cpu"), "medusa")
        if heads is None or heads == "init":
            raise MedusaError("mode vllm-heads needs trained heads: pass --heads FOLDER")
    tmp = tempfile.TemporaryDirectory(prefix=f"bench-{name}-")
    _EXPORTS.append(tmp)
    return export_for_vllm(heads, args.model, Path(tmp.name) / "heads")


def worker(name: str, args: argparse.Namespace):
    """The mode's worker, started on first use (the bench's warm-up)."""
    if name not in WORKERS:
        from medusa.models.target import default_model_dir
        from medusa.peers.vllm_client import VLLMWorker

        if args.dtype not in (None, "float32", "fp32"):
            raise MedusaError(f"the vllm modes decode in float32 here; drop --dtype {args.dtype} or the vllm modes")
        model = args.model or str(default_model_dir())
        WORKERS[name] = VLLMWorker(model, speculative_config(name, args))
    return WORKERS[name]


def close_all() -> None:
    for w in WORKERS.values():
        w.close()
    WORKERS.clear()
    for tmp in _EXPORTS:
        tmp.cleanup()
    _EXPORTS.clear()


def register(mode: Callable, run_type: type) -> None:
    """Register the vLLM modes with the bench's ``mode`` decorator; ``run_type`` is its ``Run``."""

    def runner(name: str):
        def run(engine, ids: list[int], bench):  # bench: medusa.bench.records.Bench (its args are the CLI's)
            out = worker(name, bench.args).generate(ids, bench.max_new_tokens)
            spec = out["spec"]
            # Every target pass emits its accepted draft tokens plus one.
            steps = len(out["tokens"]) - spec["accepted_tokens"]
            return run_type(tokens=out["tokens"], seconds=out["seconds"], steps=steps)
        return run

    for name in ("vllm", "vllm-ngram", "vllm-heads", "vllm-eagle", "vllm-eagle3"):
        mode(name)(runner(name))
    atexit.register(close_all)
