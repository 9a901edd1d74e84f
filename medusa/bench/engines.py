"""The engines a bench run's modes decode on: the main one from the command line, and one per
heads kind, compiled twin, hybrid with lookahead or kernels a mode names, each loaded once through
``medusa.load`` on the same target; what their proposals are and how they were sized."""

from __future__ import annotations

import argparse
import dataclasses

import medusa
from medusa.bench.modes import UNSHIPPED, ModeSpec, mode_spec
from medusa.bench.records import Bench
from medusa.bench.runners import plain_targets
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.decoding.sampling import SamplingConfig
from medusa.errors import MedusaError
from medusa.models import kinds
from medusa.models.target import set_chat_template

AUTOTUNE = {"on": True, "cached": "cached", "off": False}  # --autotune -> medusa.load(autotune=...)


def static_tree(engine: Engine, tree: str | None) -> str | None:
    """--tree for an engine with Medusa heads; eagle heads grow their own tree per step."""
    return tree if drafts(engine) is False else None


def drafts(engine: Engine) -> bool | None:
    """Whether the engine's heads draft per step, sized for the machine (False: a static tree;
    None: no heads)."""
    return None if engine.heads is None else kinds.kind(engine.heads.config.kind).drafts_per_step


def sizes_reason(engine: Engine) -> str | None:
    """How the eagle or block heads' trees were sized (None: neither)."""
    if not drafts(engine):
        return None
    trees = engine.plan.decision("trees")
    return trees.reason if trees is not None else "calibrated for the device type"


def lookahead_reason(engine: Engine) -> str:
    """Mode lookahead's W, N, G on ``engine`` and why."""
    proposer = engine.proposer("lookahead")
    return f"{proposer.describe()}: {proposer.size.reason}"


def _heads_source(bench: Bench, kind: str):
    """The heads of ``kind`` a mode runs: the loaded ones if of that kind (and not overridden),
    else --eagle-heads / --medusa-heads, else the kind shipped for the embedded model."""
    main, given = bench.main, getattr(bench.args, f"{kind}_heads")
    if given is None and main.heads is not None and main.heads.config.kind == kind:
        return main.heads
    if given is None and kind in UNSHIPPED:
        raise MedusaError(f"modes on {kind} heads need a folder of them: pass --heads FOLDER or --{kind}-heads FOLDER "
                          f"(no {kind} heads ship with this install)")
    return given or kind  # "medusa"/"eagle": medusa.load's shipped heads of that kind


def engine_for(bench: Bench, spec: ModeSpec) -> Engine:
    """The engine ``spec`` runs on, loaded through ``medusa.load`` on the bench's target (once)."""
    main = bench.main
    heads = main.heads if spec.kind is None else _heads_source(bench, spec.kind)
    slot = (None if heads is main.heads else spec.kind, spec.compiled, spec.lookahead, spec.kernels)
    if slot not in bench.engines:
        a = bench.args
        proposers = dataclasses.replace(main.proposer_config, hybrid_lookahead=spec.lookahead)
        engine = medusa.load(target=main, heads=heads, static_cache=a.static_cache, compile=spec.compiled or a.compile,
                             proposers=proposers, draft_dtype=a.draft_dtype, autotune=AUTOTUNE[a.autotune],
                             kernels=spec.kernels)
        if spec.kind is not None and engine.heads.config.kind != spec.kind:
            flag = f"--{spec.kind}-heads" if getattr(a, f"{spec.kind}_heads") else "--heads"
            raise MedusaError(f"{flag} {getattr(a, f'{spec.kind}_heads') or a.heads} holds "
                              f"{engine.heads.config.kind} heads: pass a folder of {spec.kind} heads")
        bench.engines[slot] = engine
    return bench.engines[slot]


def load_bench(args: argparse.Namespace) -> Bench:
    """The main engine through ``medusa.load`` and the run's settings."""
    wanted = set(args.modes.split(",")) if args.modes else set()
    draft = args.draft or ("default" if {"draft", "hf-assisted"} & wanted else None)
    proposers = ProposerConfig(draft_tokens=args.draft_tokens, adaptive_draft=args.adaptive_draft,
                               draft_confidence=args.draft_confidence, lookup_tokens=args.lookup_tokens,
                               lookup_ngram=args.lookup_ngram, answer_ngrams=args.answer_ngrams, draw=args.draw,
                               draft_window=args.draft_window or None, check_drafting=not args.every_step_drafts,
                               match_chains=getattr(args, "match_chains", True),
                               **dict(zip(("lookahead_window", "lookahead_ngram", "lookahead_guesses"),
                                          args.lookahead or ())))
    engine = medusa.load(model=args.model, heads=args.heads, draft=draft, device=args.device, dtype=args.dtype,
                         tree=None, static_cache=args.static_cache, compile=args.compile, proposers=proposers,
                         kernels=args.kernels, draft_dtype=args.draft_dtype, autotune=AUTOTUNE[args.autotune])
    set_chat_template(engine.tokenizer, args.chat_template)  # every engine of the run encodes with the main one's
    sampling = SamplingConfig().override(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                         seed=args.seed, acceptance=args.acceptance)
    return Bench(args=args, sampling=sampling, max_new_tokens=args.max_new_tokens, tree=args.tree,
                 engines={(None, False, False, None): engine})


def prepare(bench: Bench, modes: list[str]) -> None:
    """Every engine the modes run on, loaded before any timing; --tree used by one of them."""
    specs = [s for s in map(mode_spec, modes) if s is not None]
    engines = [(s, engine_for(bench, s)) for s in specs]
    static = [s.base for s, e in engines if s.base in ("medusa", "hybrid") and drafts(e) is False]
    if bench.tree is not None and not static:
        raise MedusaError(f"--tree shapes the static tree of Medusa heads (modes medusa, hybrid on Medusa heads), which "
                          f"none of {', '.join(modes)} uses (eagle heads grow their tree per step): drop --tree")
    bench.plain_targets = plain_targets(modes, bench.args, bench.main.device)


def eagle_engine(bench: Bench) -> Engine | None:
    """The engine the eagle (or block) modes ran on (loaded for them, else the main one with such heads)."""
    eager = [(kind, e) for (kind, compiled, _, _), e in bench.engines.items() if not compiled]
    found = [e for kind, e in eager if kind is not None and kinds.kind(kind).sized] + [e for _, e in eager if drafts(e)]
    return found[0] if found else None
