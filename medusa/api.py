"""``medusa.load``: the one call benchmarks, the chat and users start from."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from medusa.autotune.planner import Planner, make_plan
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.errors import MedusaError
from medusa.hub.hub import load_heads_from
from medusa.models.draft import load_draft
from medusa.models.heads import MedusaHeads
from medusa.models.loader import init_heads_for, load_heads
from medusa.models.target import DEFAULT_MODEL_NAME, embedded_folder, load_target

# Medusa heads shipped with the repo for the embedded default model (heads="medusa").
SHIPPED_HEADS = Path(__file__).resolve().parent / "assets" / "heads" / "smollm2-135m-instruct"
# EAGLE heads shipped for the same model (heads="eagle"), vLLM's EAGLE-1 layout.
SHIPPED_EAGLE_HEADS = SHIPPED_HEADS.with_name("smollm2-135m-instruct-eagle")
# EAGLE-3 heads for the same model (heads="eagle3"): three target layers fused, 7 steps unrolled;
# the default heads of medusa.load() on a CPU, since their hybrid mode measured fastest there
# (docs/benchmarks/2026-11-28-epyc-zen4-eagle3.md).
SHIPPED_EAGLE3_HEADS = SHIPPED_HEADS.with_name("smollm2-135m-instruct-eagle3")


def shipped_heads_for(device: torch.device) -> Path | None:
    """The shipped heads that measured fastest on ``device``'s type, else the next present. On a
    CPU the EAGLE-3 heads (their hybrid mode beat the EAGLE heads' on held-out prompts:
    docs/benchmarks/2026-11-28-epyc-zen4-eagle3.md); on CUDA the Medusa heads, whose hybrid mode beat
    the EAGLE heads' in eager passes (docs/benchmarks/2026-11-26-h200.md#eager-passes): a GPU pass is
    launch-bound and costs the same for 1 or 64 tokens, so the EAGLE heads' six sequential draft steps cost more
    than their extra accepted tokens save (the EAGLE-3 heads are not measured on a GPU yet)."""
    order = ((SHIPPED_HEADS, SHIPPED_EAGLE3_HEADS, SHIPPED_EAGLE_HEADS) if device.type == "cuda"
             else (SHIPPED_EAGLE3_HEADS, SHIPPED_EAGLE_HEADS, SHIPPED_HEADS))
    return next((f for f in order if (f / "config.json").is_file()), None)


SHIPPED = {"medusa": SHIPPED_HEADS, "eagle": SHIPPED_EAGLE_HEADS, "eagle3": SHIPPED_EAGLE3_HEADS}  # heads="medusa" / ...


def default_heads(model_arg: str | None, device: torch.device, kind: str | None = None) -> Path | None:
    """The one place the default heads are chosen: for the embedded default target, the shipped
    heads of ``kind`` ("medusa", "eagle" or "eagle3"), or with no kind the kind that measured fastest on
    this device type (:func:`shipped_heads_for`); for any other target none."""
    if kind is not None and kind not in SHIPPED:
        raise MedusaError(f"unknown heads kind {kind!r}: use one of {', '.join(SHIPPED)}, a folder or a Hub id")
    if model_arg is not None:
        return None
    if kind is None:
        return shipped_heads_for(device)
    return SHIPPED[kind] if (SHIPPED[kind] / "config.json").is_file() else None


def resolve_heads(heads: str | torch.nn.Module | None, model_arg: str | None, model: torch.nn.Module) -> MedusaHeads | None:
    """``None``: :func:`default_heads` (the shipped heads when the target is the embedded
    default, else no heads); ``"medusa"``/``"eagle"``/``"eagle3"``: the shipped heads of that kind;
    ``"init"``: fresh, untrained heads for this target; a folder (ours or FasterDecoding's
    Medusa-1 layout) or a Hub id ``USER/NAME``: heads saved there (see :mod:`medusa.hub.hub`)."""
    if isinstance(heads, torch.nn.Module):  # heads already loaded (Medusa or EAGLE)
        shared = isinstance(heads, MedusaHeads) and heads.config.projection == "shared"
        return heads.bind(model.get_output_embeddings()) if shared else heads
    if heads is None or heads in SHIPPED:  # a folder of that name: pass "./medusa"
        folder = default_heads(model_arg, model.get_output_embeddings().weight.device, heads)
        if folder is None and heads is not None:
            raise MedusaError(f"the shipped {heads} heads are for the embedded default model: pass heads=FOLDER "
                              f"(--heads FOLDER) for {model_arg}")
        return None if folder is None else load_heads(folder, model)
    if heads == "init":
        return init_heads_for(model)
    return load_heads_from(heads, model)


def _target_name(lm) -> str | None:
    """A reused target's name for :func:`default_heads`: None when it is the embedded default
    (loaded from its folder), so the shipped heads apply to it."""
    here = getattr(lm, "name_or_path", None)
    return None if here and Path(here) == embedded_folder() else "the given target"


def _reuse(target: Engine | torch.nn.Module, dtype, trust_remote_code: bool):
    """``(lm, tokenizer, draft, base plan)`` of a target already loaded."""
    if dtype is not None:
        raise MedusaError("dtype= converts a target as it loads: drop it with target= (the target keeps its dtype)")
    if isinstance(target, Engine):
        return target.model, target.tokenizer, target.draft, target.plan
    return target, None, None, None


def load(
    model: str | None = None,
    heads: str | torch.nn.Module | None = None,
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
    autotune: bool | str = True,
    target: Engine | torch.nn.Module | None = None,
) -> Engine:
    """Load a target (``None``: the embedded default), its heads, and return an :class:`Engine`.

    ``heads``: :func:`resolve_heads` (``None``: :func:`default_heads`). ``draft`` (``mode="draft"``):
    a model folder, Hub id, ``.gguf`` file or ``"default"`` sharing the target's tokenizer
    (:func:`medusa.draft.load_draft`), drafting ``draft_tokens`` per step (``adaptive_draft``:
    adapted per step). ``tree`` shapes the static tree of Medusa heads; eagle heads grow
    theirs per step, so a tree with them is an error.

    ``static_cache``: fixed KV tensors; ``compile``: each value documented on :class:`Engine`.

    ``autotune``: the machine plan (medusa/autotune/planner.py, docs/machine-plan.md): the
    target's dtype, linear kernels, exact rows per pass in half precision, the heads' drafting
    dtype, EAGLE tree sizes. ``True`` measures what the cache (``plan.json``) lacks, once per
    machine; ``"cached"`` uses what is cached and the defaults for the rest, measuring nothing;
    ``False`` measures nothing, writes nothing, and uses :meth:`Plan.default`. ``dtype``,
    ``kernels`` (``"default"``, ``"onednn"``, ``"gemv"`` or a split such as ``"gemv>3"``) and ``draft_dtype`` (the heads' dtype, drafts
    only: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"int8"``) override their step.
    ``engine.describe()`` says what was picked, why, and what measuring it cost.

    ``target``: a target already loaded, as an Engine (its model, tokenizer, draft, heads unless
    ``heads`` names others, and plan's target decisions are reused) or a transformers model.
    """
    planner = Planner(autotune)
    if target is None:
        lm, tokenizer = load_target(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        base, draft_lm = None, None
    else:
        lm, tokenizer, draft_lm, base = _reuse(target, dtype, trust_remote_code)
    if draft is not None:
        draft_lm = load_draft(draft, lm, tokenizer, target_name=model or DEFAULT_MODEL_NAME,
                              embedded_target=model is None, trust_remote_code=trust_remote_code)
    overrides = {k: v for k, v in (("draft_tokens", draft_tokens), ("adaptive_draft", adaptive_draft)) if v is not None}
    config = dataclasses.replace(proposers or ProposerConfig(), **overrides)
    if base is None:  # the target's decisions first: heads are loaded in the picked dtype
        base = make_plan(lm, None, dtype_asked=dtype is not None, kernels=kernels, compile=compile, planner=planner)
    if target is not None:  # a given target keeps its own heads (none for a bare model) unless others are named
        heads = heads if heads is not None else getattr(target, "heads", None) if isinstance(target, Engine) else None
    heads = resolve_heads(heads, model if target is None else _target_name(lm), lm)
    plan = make_plan(lm, heads, kernels=kernels, draft_dtype=draft_dtype, compile=compile, base=base, planner=planner)
    engine = Engine(lm, tokenizer, heads=heads, tree=tree, draft=draft_lm, static_cache=static_cache, compile=compile,
                    proposer_config=config, plan=plan)
    return planner.refresh(engine)  # a cached pass curve checked against this machine now, on its own kernels
