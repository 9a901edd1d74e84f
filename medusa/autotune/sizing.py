"""EAGLE trees sized for this machine, from its own measured pass costs.

``scripts/calibrate_tree.py`` stores two things per heads folder: how many drafted tokens
the target accepts with the N best nodes of each draft shape (teacher-forced on the target's
own answers: a property of the heads and the model, not of the machine; with the lookup
chain's statistics for mode hybrid), and the size that was best on the machine it ran on.
The best size follows the pass-cost curve, and that curve differs between machines of one
device type (docs/trees.md#eagle-trees-are-sized-on-the-machine-that-runs-them), so the engine
sizes its trees here: the planner (:func:`measure_sizes`) times the engine's own pass (its
dtype, linear kernels and exact attention) for 1 to 32 new tokens and the head's work per step
for each shape (drafting and update, after a target pass as in decoding: :func:`drafting_ms`),
once per machine (cached in the plan's cache, medusa/autotune/cache.py), and picks the size with
the most expected tokens per second for mode eagle and, chain length included, for mode hybrid
(:func:`medusa.autotune.trees.choose_dynamic`). A CPU engine with compiled passes runs a
proposal of n rows padded to its pass bucket (``passes.pass_bucket``), so it is sized with
T(bucket(n)): a 14-row hybrid pass costs a 16-row one there, and the nodes that fill the
bucket come free. Compiled engines off the CPU keep the calibrated sizes.

Block heads (``kind: block``) are sized by the same code: a shape ``(depth, topk)`` is their
top-1 chain of ``depth`` tokens with ``topk`` candidates per depth
(:mod:`medusa.decoding.proposers.block`), ``nodes`` the best of those verified, and mode eagle's
size is mode block's (``Plan.eagle``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from medusa.autotune.timing import measure_cost
from medusa.autotune.trees import Acceptance, choose_dynamic, interpolate, shallower
from medusa.decoding.passes.strategies import pass_bucket
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.proposers.lookahead import LookaheadSize, size_lookahead
from medusa.decoding.state import DecodeState, StepOutcome
from medusa.decoding.tree import tree_key
from medusa.models.kinds import kind
from medusa.runtime import hf as kv

SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)  # new tokens per pass, timed
PREFIX = 256  # cached tokens before the timed passes (a prompt and part of an answer)
# longer contexts the same passes are timed after: a row attends to every cached token, so the
# rows beyond the first cost more there (docs/performance.md#a-pass-at-long-context); the cached
# positions are random keys and values written into the cache (timing.measure_cost's ``filled``)
CONTEXTS = (1024, 2048, 4096, 8000)
LONG_REPS = 5  # timed rounds at contexts of 4096 tokens and more (a round there takes a second)
# the context lengths trees are sized for beside PREFIX (the cost between and beyond the timed
# contexts linear in the length, as attention's is); a size applies from 3/4 of its length on
LENGTHS = (512, 1024, 2048, 4096, 8000)
# Timed rounds per pass size and per draft shape: enough that sizings in a row on one machine
# pick the same hybrid tree, which 7 rounds did not (docs/performance.md#where-a-decode-steps-time-goes).
REPS = 13
# The cached curve is checked at each load: one-row passes timed now (PROBE_REPS), and where they
# run under FASTER times the cached one-row pass, the curve is timed again (RETIME_REPS rounds) and
# kept if it is still faster. The timings of one VM differ by state for minutes at a time, and a
# curve timed in the slower state prices extra rows at half what they cost in the faster one
# (docs/benchmarks/2026-12-05-epyc-zen4-fresh-curve.md).
PROBE_REPS = 5
RETIME_REPS = 3
FASTER = 0.93


@dataclass(frozen=True)
class SizeChoice:
    eagle: DynamicTree  # mode eagle's tree
    hybrid: DynamicTree  # mode hybrid's tree, with its lookup chain
    reason: str  # one line for the chat banner and the bench
    cost_ms: dict[int, float]  # the engine's pass over n new tokens, measured here
    draft_ms: dict[str, float]  # the head's work per step (drafting, update) per shape "DEPTHxTOPK", measured here
    lookahead: LookaheadSize | None = None  # mode lookahead's W, N, G for the same pass costs
    # the pass over n new tokens after each of LENGTHS cached tokens, as sized ({}: not timed there)
    cost_by_length: dict[int, dict[int, float]] = field(default_factory=dict)


def measured_curves(heads, device: torch.device, dtype: torch.dtype) -> dict[tuple[int, int], Acceptance]:
    """The heads' teacher-forced acceptance per draft shape from their calibration (the entry
    for this device and dtype first: its drafting ran in the same dtype; else any entry)."""
    entry = _curves_entry(heads, device, dtype)
    return {} if entry is None else _curves(entry["curves"])


def curves_by_context(heads, device: torch.device, dtype: torch.dtype) -> dict[int, dict[tuple[int, int], Acceptance]]:
    """The same acceptance measured on long prompts, per context length (one of ``LENGTHS``:
    prompts from 3/4 of it on; ``scripts/calibrate_tree.py --long-prompts``); empty where none."""
    entry = _curves_entry(heads, device, dtype)
    return {int(length): _shallower(heads, _curves(curves))
            for length, curves in ((entry or {}).get("curves_by_context") or {}).items()}


def _shallower(heads, curves: dict[tuple[int, int], Acceptance]) -> dict[tuple[int, int], Acceptance]:
    """EAGLE heads' curves with their shallower shapes (:func:`~medusa.autotune.trees.shallower`);
    block heads draft a whole block in one pass, whatever its depth: theirs as calibrated."""
    return curves if kind(heads.config.kind).block_trained else shallower(curves)


def _curves_entry(heads, device: torch.device, dtype: torch.dtype) -> dict | None:
    measured = getattr(heads, "measured", None) or {}
    keys = [tree_key(device.type, dtype), device.type] + sorted(measured)
    return next((measured[k] for k in keys if isinstance(measured.get(k), dict) and measured[k].get("curves")), None)


def _curves(records: dict) -> dict[tuple[int, int], Acceptance]:
    return {tuple(int(x) for x in shape.split("x")): Acceptance.from_record(record) for shape, record in records.items()}


def context_bucket(length: int) -> int | None:
    """The sizing length (``LENGTHS``) a prompt of ``length`` tokens stands for: the longest
    whose sizes apply at it (from 3/4 of the length on); None below the first."""
    return max((n for n in LENGTHS if n * 3 // 4 <= length), default=None)


@torch.inference_mode()
def drafting_ms(heads, model, shapes: list[tuple[int, int]], reps: int = REPS) -> dict[str, float]:
    """Median milliseconds of the head's work in one decoding step per ``(depth, topk)`` shape:
    its drafting and its update with the step's accepted pairs (two here), timed as decoding
    runs them: right after a target pass, which streams the target's weights through the CPU's
    caches, with a prefill's worth of context. Timed back to back instead, the head's weights
    stay cached and the drafting looks cheaper than it is
    (docs/performance.md#where-a-decode-steps-time-goes)."""
    device = heads.fc.weight.device
    ids = (torch.arange(PREFIX, device=device) * 7919 + 13) % (model.config.vocab_size - 1) + 1
    cache = kv.new_cache()
    _, hidden = kv.forward(model, ids[None], torch.arange(PREFIX, device=device)[None], cache, None,
                           logits_rows=slice(-1, None), layers=getattr(heads, "feature_layers", None))
    root = torch.tensor([[PREFIX - 1]], device=device)
    accepted = StepOutcome(nodes=[0, 1], tokens=ids[-2:].tolist(), hidden=hidden[-2:], start=PREFIX - 1)
    state = DecodeState(cache=None, tokens=ids.tolist(), length=PREFIX - 1, root=ids[-1], hidden=hidden[-2],
                        logits=None, prefill_hidden=hidden[:-1])  # read, never changed, by the proposer
    out = {}
    for depth, topk in shapes:
        proposer = drafter(heads, device, depth, topk)
        times = []
        for _ in range(reps + 1):
            proposer.begin(state)  # the head's cache as a prefill leaves it (the last step's pairs dropped)
            kv.crop(cache, PREFIX - 1)
            kv.forward(model, ids[None, -1:], root, cache, None)  # the step's target pass, untimed
            t0 = time.perf_counter()
            proposer.propose(state)
            proposer.update(state, accepted)
            times.append(time.perf_counter() - t0)
        out[f"{depth}x{topk}"] = statistics.median(times[1:]) * 1e3
    return out


def drafter(heads, device: torch.device, depth: int, topk: int):
    """The proposer of ``heads``' kind drafting its largest proposal of shape ``(depth, topk)``:
    the kind's proposer says what that is (``HeadsProposer.shape``)."""
    cls = kind(heads.config.kind).proposer_class()
    return cls.for_heads(heads, device, size=cls.shape(depth, topk))


def measure_sizes(model, heads, scope, max_rows: int | None, shapes: list[tuple[int, int]]) -> dict:
    """The timings sizing needs: the target's pass for each of ``SIZES`` (up to ``max_rows``)
    after ``PREFIX`` cached tokens and after each of ``CONTEXTS`` the model's positions reach,
    and the head's work per draft shape, inside ``scope`` (the engine's linear kernels)."""
    sizes = [n for n in SIZES if n <= (max_rows or SIZES[-1])]
    longest = getattr(kv.text_config(model), "max_position_embeddings", None) or PREFIX + max(sizes)
    with scope:
        cost = measure_cost(model, sizes, prefix=PREFIX, reps=REPS)
        by_context = {str(c): {str(n): ms for n, ms in measure_cost(model, sizes, prefix=c, filled=True,
                                                                   reps=REPS if c < 4096 else LONG_REPS).items()}
                      for c in CONTEXTS if c + max(sizes) <= longest}
        draft = drafting_ms(heads, model, shapes)
    return {"cost_ms": {str(n): ms for n, ms in cost.items()}, "draft_ms": draft, "cost_by_context": by_context}


def faster_curve(model, scope, entry: dict) -> dict | None:
    """``entry`` (:func:`measure_sizes`' timings, from the cache) with its pass curve timed again,
    where this machine runs a one-row pass clearly faster now than when the curve was timed;
    None where it does not (the check costs a prefill and a few one-row passes). The curves at
    longer contexts are scaled per size by the same ratio (the state changes a pass of n rows
    alike at every length). Only a faster curve replaces a cached one, so a load timed while the
    machine is busy or in its slower state never makes the sizing worse."""
    cached = {int(n): float(ms) for n, ms in entry["cost_ms"].items()}
    if 1 not in cached:
        return None
    with scope:
        if measure_cost(model, [1], prefix=PREFIX, reps=PROBE_REPS)[1] >= FASTER * cached[1]:
            return None
        curve = measure_cost(model, sorted(cached), prefix=PREFIX, reps=RETIME_REPS)
    if curve[1] >= FASTER * cached[1]:
        return None
    ratio = {n: curve[n] / cached[n] for n in cached}
    by_context = {c: {n: ms * ratio.get(int(n), 1.0) for n, ms in timed.items()}
                  for c, timed in (entry.get("cost_by_context") or {}).items()}
    return {**entry, "cost_ms": {str(n): ms for n, ms in curve.items()}, "cost_by_context": by_context,
            "retimed_from": cached[1]}


def cost_at(entry: dict, length: int) -> dict[int, float]:
    """The pass cost curve after ``length`` cached tokens, from ``entry``'s timings: at a timed
    context as timed, between two linear in the length, beyond the last along its last segment
    (attention's cost grows linearly with the tokens it reads), below ``PREFIX`` as at ``PREFIX``;
    made non-decreasing in the rows (:func:`monotone`)."""
    timed = {PREFIX: {int(n): ms for n, ms in entry["cost_ms"].items()}}
    for context, curve in (entry.get("cost_by_context") or {}).items():
        timed[int(context)] = {int(n): ms for n, ms in curve.items()}
    contexts = sorted(timed)
    if length <= contexts[0] or len(contexts) == 1:
        return monotone(timed[contexts[0]])
    a, b = next(((x, y) for x, y in zip(contexts, contexts[1:]) if length <= y), tuple(contexts[-2:]))
    share = (length - a) / (b - a)
    rows = sorted(set(timed[a]) & set(timed[b]))
    return monotone({n: max(timed[a][n] + share * (timed[b][n] - timed[a][n]), 1e-6) for n in rows})


def heads_fingerprint(heads) -> str:
    """What of the heads the sizing's timings depend on (part of the cache key)."""
    facts = kind(heads.config.kind)
    if facts.fused:  # its own lm_head: the draft vocabulary it always scores
        vocab = heads.config.draft_vocab_size
    else:
        vocab = heads.config.vocab_size if heads.draft_vocab is None else heads.draft_vocab.numel()
    block = f" k{heads.config.num_heads} l{heads.config.num_layers}" if facts.block_trained else ""
    return (f"{heads.config.kind} h{heads.config.hidden_size} v{vocab}{block} {heads.fc.weight.dtype}"
            + (" int8" if heads.int8 else ""))


def sizable(heads, device: torch.device, dtype: torch.dtype, compile) -> dict[tuple[int, int], Acceptance]:
    """The acceptance curves to size ``heads``' trees from; empty where the heads are not eagle
    or block heads, carry no curves, or their passes compile off the CPU (then the calibrated sizes
    apply). A CPU engine with compiled passes is sized from the eager passes' costs at its padded
    sizes (:func:`bucketed`): compiled passes measured about equally cheaper than eager ones at
    every size (docs/compile.md#compiled-exact-passes), a curve of the same shape."""
    if heads is None or not kind(heads.config.kind).sized or (compile and compile != "auto" and device.type != "cpu"):
        return {}
    return _shallower(heads, measured_curves(heads, device, dtype))


def sizes_from(entry: dict, curves: dict[tuple[int, int], Acceptance], max_rows: int | None,
               compiled: bool, device_type: str = "cpu",
               by_context: dict[int, dict[tuple[int, int], Acceptance]] | None = None) -> SizeChoice:
    """Mode eagle's and mode hybrid's trees from the timings ``entry`` (:func:`measure_sizes`), each
    with the smaller sizes it switches to at longer contexts (``DynamicTree.longer``, sized from
    the pass cost there: :func:`cost_at`, and the acceptance measured there where ``by_context``
    has it, within the short context's draft shape)."""
    cost = cost_at(entry, PREFIX)
    if compiled:
        cost = bucketed(cost)
    draft = entry["draft_ms"]
    here = {shape: replace(acc, draft_ms=draft.get(f"{shape[0]}x{shape[1]}", acc.draft_ms))
            for shape, acc in curves.items()}
    eagle, eagle_tokens, eagle_tps = choose_dynamic(here, cost, max_rows=max_rows)
    hybrid, hybrid_tokens, hybrid_tps = choose_dynamic(here, cost, hybrid=True, max_rows=max_rows)
    if entry.get("cost_by_context"):
        eagle, hybrid = (by_length(entry, here, size, max_rows, compiled, hybrid=mode, by_context=by_context)
                         for size, mode in ((eagle, False), (hybrid, True)))
    reason = (f"sized here: eagle {_describe(eagle)} ({eagle_tokens:.2f} tokens/pass expected, {eagle_tps:.1f} tokens/s), "
              f"hybrid {_describe(hybrid)} ({hybrid_tokens:.2f}, {hybrid_tps:.1f} tokens/s); this machine's pass "
              f"T(1)={cost[1]:.1f} ms, T({max(cost)})={cost[max(cost)]:.1f} ms"
              + "".join(f", after {c} tokens T(1)={curve[str(1)]:.1f} ms"
                        for c, curve in sorted(entry.get("cost_by_context", {}).items(), key=lambda kv_: int(kv_[0])))
              + ("; compiled passes padded to their buckets" if compiled else "")
              + (f"; timed again at a load that found T(1) under the cached {entry['retimed_from']:.1f} ms"
                 if "retimed_from" in entry else ""))
    lookahead = size_lookahead(cost, device_type, max_rows)
    longer = {n: cost_at(entry, n) for n in LENGTHS} if entry.get("cost_by_context") else {}
    if compiled:
        longer = {n: bucketed(c) for n, c in longer.items()}
    return SizeChoice(eagle=eagle, hybrid=hybrid, reason=reason, cost_ms=cost, draft_ms=draft, lookahead=lookahead,
                      cost_by_length=longer)


def by_length(entry: dict, curves: dict[tuple[int, int], Acceptance], size: DynamicTree, max_rows: int | None,
              compiled: bool, hybrid: bool, by_context: dict[int, dict[tuple[int, int], Acceptance]] | None = None,
              ) -> DynamicTree:
    """``size`` (sized at ``PREFIX``) with the sizes it switches to at each of ``LENGTHS``, where
    they differ: sized from the pass cost at that length and the acceptance measured at the
    longest calibrated length up to it (``by_context``; else the short prompts'), within the size
    of the length before (``size``'s draft shape, no more nodes, no longer a chain: noise never
    grows a tree back as the context grows), applying from 3/4 of the length on."""
    longer, last = [], replace(size, longer=())
    for length in LENGTHS:
        cost = cost_at(entry, length)
        if compiled:
            cost = bucketed(cost)
        measured = max((n for n in (by_context or {}) if n <= length), default=None)
        # (drafting as timed here: a windowed head drafts at the same cost at any length)
        here_curves = curves if measured is None else {shape: replace(acc, draft_ms=curves[shape].draft_ms)
                                                       for shape, acc in by_context[measured].items() if shape in curves}
        # within the size chosen for the length before: a longer context never gets a larger tree
        here = choose_dynamic(here_curves or curves, cost, hybrid=hybrid, max_rows=max_rows, within=last)[0]
        if size.nodes and not here.nodes:  # no tree: the proposer still drafts the shape, verifies none
            here = replace(here, depth=size.depth, topk=size.topk)
        if here != last:
            longer.append((length * 3 // 4, here))
            last = here
    return replace(size, longer=tuple(longer))


def bucketed(cost_ms: dict[int, float]) -> dict[int, float]:
    """The cost of a compiled pass of n rows, for every n up to the largest timed: the (eager,
    interpolated) cost of the bucket it runs padded to. Beyond the last bucket, n itself."""
    return {n: interpolate(cost_ms, pass_bucket(n)) for n in range(1, max(cost_ms) + 1)}


def monotone(cost_ms: dict[int, float]) -> dict[int, float]:
    """The non-decreasing curve closest to measured pass costs (least squares: adjacent
    violators pool into their mean). A pass over more tokens never costs less; where a timing
    says so (noise on a shared machine can make one token time slower than two:
    docs/trees.md#eagle-trees-are-sized-on-the-machine-that-runs-them), that is noise, which
    would otherwise make the rows it undercuts look free."""
    blocks: list[list] = []  # [sum, count, sizes]
    for n in sorted(cost_ms):
        blocks.append([cost_ms[n], 1, [n]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count, sizes = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
            blocks[-1][2] += sizes
    return {n: total / count for total, count, sizes in blocks for n in sizes}


def _describe(size: DynamicTree) -> str:
    tree = "no tree" if size.nodes == 0 else f"{size.nodes} nodes (depth {size.depth}, top-{size.topk})"
    text = tree if size.chain is None else f"{tree} + {size.chain}-token lookup chain"
    return text + size.describe_longer()
