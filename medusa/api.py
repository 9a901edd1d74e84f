"""``medusa.load``: the one call benchmarks, the chat and users start from."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from medusa.autotune.device import (
    DtypeChoice,
    KernelChoice,
    adopt_draft_dtype,
    adopt_picked_dtype,
    exact_rows,
    pick_kernels,
)
from medusa.autotune.sizing import size_here
from medusa.decoding.engine import Engine
from medusa.decoding.proposers import ProposerConfig
from medusa.hub.hub import load_heads_from
from medusa.models.draft import load_draft
from medusa.models.heads import MedusaHeads
from medusa.models.loader import init_heads_for, load_heads
from medusa.models.target import DEFAULT_MODEL_NAME, load_target
from medusa.runtime.files import cache_root

# Medusa heads shipped with the repo for the embedded default model (mode medusa; the bench's
# medusa and hybrid modes).
SHIPPED_HEADS = Path(__file__).resolve().parent / "assets" / "heads" / "smollm2-135m-instruct"
# EAGLE heads shipped for the same model: the default heads of medusa.load() and the chat on a
# CPU, since their hybrid mode measured fastest there (docs/benchmarks/README.md); the bench's eagle modes.
SHIPPED_EAGLE_HEADS = SHIPPED_HEADS.with_name("smollm2-135m-instruct-eagle")


def shipped_heads_for(device: torch.device) -> Path | None:
    """The shipped heads that measured fastest on ``device``'s type, else the other kind where
    only that one is present. On a CPU the EAGLE heads; on CUDA the Medusa heads, whose hybrid
    mode ran 1.19x the EAGLE heads' on an H200 (eagerly; docs/benchmarks/2026-11-26-h200.md#eager-passes): a pass is launch-bound
    there and costs the same for 1 or 64 tokens, so the EAGLE heads' six sequential draft steps
    cost more than their extra accepted tokens save."""
    order = (SHIPPED_HEADS, SHIPPED_EAGLE_HEADS) if device.type == "cuda" else (SHIPPED_EAGLE_HEADS, SHIPPED_HEADS)
    return next((f for f in order if (f / "config.json").is_file()), None)


def resolve_heads(heads: str | MedusaHeads | None, model_arg: str | None, model: torch.nn.Module) -> MedusaHeads | None:
    """``None``: the shipped heads when the target is the embedded default (else no heads): the
    EAGLE heads, or on CUDA the Medusa heads (:func:`shipped_heads_for`);
    ``"init"``: fresh, untrained heads for this target; a folder (ours or FasterDecoding's
    Medusa-1 layout) or a Hub id ``USER/NAME``: heads saved there (see :mod:`medusa.hub.hub`)."""
    if isinstance(heads, MedusaHeads):
        return heads.bind(model.get_output_embeddings()) if heads.config.projection == "shared" else heads
    if heads is None:
        if model_arg is None:
            shipped = shipped_heads_for(model.get_output_embeddings().weight.device)
            return None if shipped is None else load_heads(shipped, model)
        return None
    if heads == "init":
        return init_heads_for(model)
    return load_heads_from(heads, model)


def _exact_pass_rows(lm, picked: DtypeChoice | None, kernels: str) -> int | None:
    """A half-precision target verifies at most the largest pass this device keeps exact with
    these kernels (device.invariant_rows; probed by the dtype pick, else once and cached)."""
    if lm.dtype not in (torch.bfloat16, torch.float16):
        return None
    if picked is not None and kernels == "default":
        return picked.invariant_rows
    return exact_rows(lm, cache_root() / "dtype.json", kernels)


def _picked_dtype(lm, compile: bool | str) -> DtypeChoice | None:
    """The fastest dtype that keeps the promise on this device (medusa/autotune/device.py), adopted by ``lm``.
    With ``compile=True`` off the CPU none is picked: compiled passes there are exact in float32
    only (the Engine refuses exact attention with them), so the loaded dtype is kept; on the CPU
    compiled exact passes are bit-identical to eager ones (docs/compile.md#compiled-exact-passes)."""
    if not compile or compile == "auto" or lm.device.type == "cpu":
        return adopt_picked_dtype(lm, cache_root() / "dtype.json")
    lm.dtype_choice = DtypeChoice(str(lm.dtype).removeprefix("torch."), f"compile=True on {lm.device.type}: the "
                                  "loaded dtype is kept (compiled passes are exact in float32 only there)", {})
    return None


def load(
    model: str | None = None,
    heads: str | MedusaHeads | None = None,
    draft: str | torch.nn.Module | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    tree: str | Sequence[Sequence[int]] | None = None,
    trust_remote_code: bool = False,
    draft_tokens: int | None = None,
    adaptive_draft: bool | None = None,
    static_cache: bool = False,
    compile: bool | str = False,
    proposers: ProposerConfig | None = None,
    kernels: str | None = None,
    draft_dtype: torch.dtype | str | None = None,
    size_trees: bool = True,
) -> Engine:
    """Load a target (``None``: the embedded default), its heads, and return an :class:`Engine`.

    ``draft`` (for ``mode="draft"``) is a model folder, Hub id or ``.gguf`` file sharing the
    target's tokenizer, or ``"default"`` (see :func:`medusa.draft.load_draft`); it drafts
    ``draft_tokens`` per step, adapted per step when ``adaptive_draft`` is set. ``tree`` shapes the
    static tree of Medusa heads; eagle heads grow theirs per step, so a tree with them is an error.

    ``static_cache`` keeps the KV cache in fixed tensors. ``compile`` (each value documented on
    :class:`~medusa.decoding.engine.Engine`; ``engine.passes`` says what was built): False eager;
    True compiled once per pass size (saved for later processes on a CPU, CUDA graphs on CUDA, where
    the loaded dtype is kept); ``"auto"`` (the chat's default): on a CPU saved passes where this
    machine has them, else eager (``engine.build_passes(mode)`` builds the rest); a backend's name.

    ``kernels``: the engine's linear kernels, ``"default"`` (torch's) or ``"onednn"`` (packed
    oneDNN weights on a CPU, medusa/runtime/kernels.py); ``None`` picks the faster here by
    measurement, once (cached; in half precision packed kernels must also pass the exactness
    probe), and ``"default"`` on a GPU; compiled passes keep the pick (``engine.kernel_choice``
    says which and why). Half precision verifies at most the rows the probe found exact.

    ``draft_dtype``: the heads' dtype. Heads only propose (the target verifies every token in
    its own dtype), so they may draft in bfloat16 beside a float32 target; ``None`` keeps the
    target's dtype, or picks bfloat16 for a float32 target where it measures faster on this
    device (once, cached). ``engine.draft_dtype_choice`` says which and why.

    ``size_trees``: eagle trees (and hybrid's lookup chain) sized from this machine's pass costs,
    measured once, cached (medusa/autotune/sizing.py; compiled CPU passes at their padded sizes); False: calibrated.
    """
    lm, tokenizer = load_target(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    picked = _picked_dtype(lm, compile) if dtype is None else None
    draft_lm = None if draft is None else load_draft(
        draft, lm, tokenizer, target_name=model or DEFAULT_MODEL_NAME, embedded_target=model is None,
        trust_remote_code=trust_remote_code)
    overrides = {k: v for k, v in (("draft_tokens", draft_tokens), ("adaptive_draft", adaptive_draft)) if v is not None}
    config = dataclasses.replace(proposers or ProposerConfig(), **overrides)
    choice = _kernel_choice(lm, kernels)
    max_rows = _exact_pass_rows(lm, picked, choice.kernels)
    heads = resolve_heads(heads, model, lm)
    draft_choice = None if heads is None else adopt_draft_dtype(heads, lm, cache_root() / "draft_dtype.json", draft_dtype)
    engine = Engine(lm, tokenizer, heads=heads, tree=tree, draft=draft_lm,
                    static_cache=static_cache, compile=compile, proposer_config=config, kernels=choice.kernels, max_rows=max_rows)
    engine.kernel_choice, engine.draft_dtype_choice = choice, draft_choice
    engine.tree_sizes = size_here(engine, cache_root() / "sizing.json") if size_trees else None
    return engine


def _kernel_choice(lm, kernels: str | None) -> KernelChoice:
    """The kernels asked for, else the faster here by measurement (device.pick_kernels, cached)."""
    if kernels is None:
        return pick_kernels(lm, cache_root() / "kernels.json", rows_file=cache_root() / "dtype.json")
    return KernelChoice(kernels, "asked for", {})
