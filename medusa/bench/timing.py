"""The timed part of a bench run: compiled passes built and every mode warmed up outside the
timing, then the prompts run interleaved across modes (each prompt starting one mode further),
so that machine noise hits every mode alike. Progress goes to stderr."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from medusa.bench.engines import drafts, engine_for, lookahead_reason, sizes_reason, static_tree
from medusa.bench.modes import mode_spec, runs_lookahead
from medusa.bench.prompts import Prompt, encode
from medusa.bench.records import Bench, Run
from medusa.bench.runners import MODES
from medusa.decoding.engine import Engine


def _engine_run(engine: Engine, ids: list[int], bench: Bench, *, name: str) -> Run:
    res = engine.generate(ids, max_new_tokens=bench.max_new_tokens, mode=name, tree=static_tree(engine, bench.tree),
                          sampling=bench.sampling)
    st = res.stats
    phases = {"prefill": st.prefill_seconds, "draft": st.draft_seconds, "verify": st.verify_seconds,
              "update": st.update_seconds}
    return Run(tokens=res.tokens, seconds=st.seconds, steps=st.steps + 1, accepted=list(st.accepted), phases=phases,
               first_seconds=st.prefill_seconds, plain_steps=st.plain_steps, lean_steps=st.lean_steps)


def run_mode(name: str, engine: Engine, ids: list[int], bench: Bench) -> Run:
    """One mode on one prompt: an engine mode on its engine, else the registered runner."""
    spec = mode_spec(name)
    if spec is None:
        return MODES[name](engine, ids, bench)
    return _engine_run(engine_for(bench, spec), ids, bench, name=spec.base)


def precompile(modes: list[str], bench: Bench) -> dict[str, float]:
    """Compile, before any timing, every pass size each compiled mode can use; seconds per mode."""
    seconds = {}
    for name in modes:
        spec = mode_spec(name)
        if spec is None or not engine_for(bench, spec).passes.compiled:
            continue
        engine = engine_for(bench, spec)
        t0 = time.perf_counter()
        buckets = engine.precompile(spec.base, static_tree(engine, bench.tree))
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: compiled pass sizes {', '.join(map(str, buckets))} in {seconds[name]:.1f} s", file=sys.stderr)
    return seconds


def timed_runs(bench: Bench, modes: list[str], prompts: list[Prompt]) -> dict[str, list[Run]]:
    """Warm every mode up once, then run the prompts interleaved across modes."""
    for p in prompts:
        p.ids = encode(bench.main, p.text)
    sampled = "greedy" if bench.sampling.greedy else f"temperature {bench.sampling.temperature:g}"
    print(f"{len(prompts)} prompts from {bench.args.prompts}, {bench.max_new_tokens} new tokens, {sampled}, modes: "
          f"{', '.join(modes)}", file=sys.stderr)
    for engine in {id(e): e for e in bench.engines.values()}.values():
        if drafts(engine):
            proposal = engine.proposer(engine.heads.config.kind).describe()
            print(f"{engine.heads.config.kind} heads' {proposal}{' (compiled)' if engine.passes.compiled else ''}: "
                  f"{sizes_reason(engine)}", file=sys.stderr)
    if runs_lookahead(modes):
        print(f"lookahead: {lookahead_reason(bench.main)}", file=sys.stderr)
    bench.compile_seconds = precompile(modes, bench)  # compiled passes: every size, before any timing
    short = bench.shorter(8)
    for m in modes:  # warm-up: allocator, kernels and caches, outside the timing
        run_mode(m, bench.main, prompts[0].ids, short)
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for i, p in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        for m in rotated(modes, i):
            runs[m].append(run_mode(m, bench.main, p.ids, bench))
    return runs


def rotated(modes: list[str], i: int) -> list[str]:
    """The modes in the order prompt ``i`` runs them: starting at the ``i``-th (each prompt one
    further), so no mode always runs first or right after another one. On a VM whose speed
    changes for minutes at a time, every mode then meets each spell about equally often
    (docs/benchmarks/2026-12-05-epyc-zen4-retimed-curve.md#tried-the-lookup-chain-first-the-heads-only-where-the-text-does-not-repeat)."""
    k = i % len(modes) if modes else 0
    return modes[k:] + modes[:k]
