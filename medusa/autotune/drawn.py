"""Drawn chains calibrated at a temperature: how deep heads draft a sampled request.

A sampled request's heads draw a chain from their processed distribution ``q`` and verification
keeps each drawn token with probability ``min(1, p/q)`` (medusa/decoding/proposers/drawn.py), so
the chance that depth ``d`` is kept, once its parent was, is ``beta_d = sum_v min(p_d(v), q_d(v))``.
Greedy calibration (:func:`medusa.autotune.trees.acceptance_by_size`) cannot say how deep that
pays: ``beta`` falls as the temperature spreads ``p``. This module measures it: along the target's
own answers sampled at the temperature (teacher-forced, the answer's tokens standing for the
drawn ones), at every position it takes the head's laws down a chain and the target's ``p`` at
the same positions, and averages the expected drafted tokens kept by a chain of each depth,
``E(D) = sum_{d<=D} prod_{j<=d} beta_j``. Mode hybrid puts prompt lookup's chain beside the drawn
one, its tokens point masses: where the drawn first token is rejected, the chain's first token
``c`` is kept from the residual law, with chance ``max(p(c) - q(c), 0)``, and each next one with
the target's ``p`` of it (followed along the answer while the chain matches it: an estimate from
below). The curve keeps that gain per chain length and the share of steps with a chain, and
the sizing weighs its rows (:func:`best_size`).

Tree or chain: a depth may hold ``k`` siblings drawn without replacement (the chain goes on below
the first), verified by SpecInfer's rule: sibling ``j`` is kept with ``min(1, r_j/q_j)``, ``r``
the residual ``norm(max(r - q, 0))`` after each rejection. The chance one of the first ``k`` is
kept (:func:`sibling_keeps`) is measured at every depth, so the sizing weighs a wider level's
extra rows against what its siblings keep at this temperature. ``scripts/calibrate_tree.py --temperatures`` writes
the curves into the heads' calibration.json (``drawn``, per temperature); the engine sizes a
sampled request's chain from the curve nearest its temperature and this machine's pass costs
(:func:`drawn_depths`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from medusa.autotune.trees import interpolate
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.proposers.lookup import PromptLookup
from medusa.decoding.sampling import SamplingConfig, probabilities
from medusa.decoding.state import DecodeState, StepOutcome
from medusa.decoding.tree import tree_key
from medusa.models.kinds import kind
from medusa.runtime import hf as kv

MAX_DEPTH = 8  # the deepest drawn chain calibrated
SIBLING_DRAWS = 4  # paths of rejected siblings drawn per position (the first sibling's chance is exact)


@dataclass(frozen=True)
class DrawnCurve:
    """Expected drafted tokens kept by a drawn chain of depth 1..len(kept), and a level's ms."""

    temperature: float
    kept: tuple[float, ...]
    level_ms: float
    # mode hybrid: tokens a lookup chain of length 1..len(chain) adds beside the drawn chain, per
    # step, and the share of steps that have a chain (rows it adds); () where not measured
    chain: tuple[float, ...] = ()
    chain_share: float = 0.0
    # drafted tokens kept by depth 1..D with 2, 3, .. siblings a depth (the chain below the first);
    # () where only chains were measured
    wide: tuple[tuple[float, ...], ...] = ()

    def by_width(self) -> list[tuple[int, tuple[float, ...]]]:
        """``[(width, kept by depth 1..D), ...]``, width 1 (a chain) first."""
        return [(1, self.kept)] + [(w + 2, kept) for w, kept in enumerate(self.wide)]

    def as_record(self) -> dict:
        record = {"kept": [round(k, 4) for k in self.kept], "level_ms": round(self.level_ms, 4)}
        if self.chain:
            record.update(chain=[round(k, 4) for k in self.chain], chain_share=round(self.chain_share, 4))
        if self.wide:
            record["wide"] = {str(w + 2): [round(k, 4) for k in kept] for w, kept in enumerate(self.wide)}
        return record

    @classmethod
    def from_record(cls, temperature: float, record: dict) -> DrawnCurve:
        wide = record.get("wide", {})
        return cls(float(temperature), tuple(float(k) for k in record["kept"]), float(record["level_ms"]),
                   tuple(float(k) for k in record.get("chain", ())), float(record.get("chain_share", 0.0)),
                   tuple(tuple(float(k) for k in wide[w]) for w in sorted(wide, key=int)))


def drawn_curve(heads, model, sequences: list[tuple[list[int], list[int]]], temperature: float,
                depth: int = MAX_DEPTH, top_p: float = 1.0, chain: int = 0, lookup_ngram: int = 3,
                width: int = 1, seed: int = 0) -> DrawnCurve:
    """:class:`DrawnCurve` along ``(prompt, answer)`` token lists (answers the target sampled at
    ``temperature``), the heads drafting as the engine's proposer does; with ``chain``, prompt
    lookup's chains of up to that many tokens beside them (mode hybrid); with ``width``, levels
    of up to that many drawn siblings (their rejected draws from a generator seeded ``seed``)."""
    device = next(heads.parameters()).device
    made = kind(heads.config.kind).proposer_class()
    depth = min(depth, made.deepest(heads) or depth)
    size = DynamicTree(nodes=depth, depth=depth, topk=1)  # (the calibrated size may draft nothing)
    proposer = made.for_heads(heads, device, size=size)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p)
    totals, counts, seconds, levels = [[0.0] * depth for _ in range(width)], [0] * depth, 0.0, 0
    generator = torch.Generator(device=device).manual_seed(seed)
    ids_of = heads.draft_vocab
    lookup = PromptLookup(device, num_tokens=chain, max_ngram=lookup_ngram, table=getattr(heads, "ngrams", None)) if chain else None
    gains, found, steps = [0.0] * chain, 0, 0
    for prompt, answer in tqdm(sequences, desc=f"drawn chains at T={temperature}", file=sys.stderr):
        ids = prompt + answer
        seq = torch.tensor(ids, device=device)
        with torch.inference_mode():
            hidden = kv.features(model, seq, getattr(heads, "feature_layers", None))
            target = probabilities(model(input_ids=seq[None]).logits[0], sampling)  # [T, V]
        p = len(prompt)
        state = DecodeState(cache=None, tokens=ids[: p + 1], length=p, root=seq[p], hidden=hidden[p - 1],
                            logits=None, prefill_hidden=hidden[:p], sampling=sampling)
        proposer.begin(state)
        if lookup is not None:
            lookup.begin(state)
        for t in range(p, len(ids) - 1):
            state.hidden = hidden[t - 1]  # the feature that predicted the root (Medusa heads read it)
            forced = ids[t + 1: t + 1 + depth]
            t0 = time.perf_counter()
            laws = proposer.chain_laws(state, forced)  # [S] each, over the draft vocabulary
            seconds += time.perf_counter() - t0
            levels += len(laws)
            reach = 1.0  # the chance the first siblings above depth d were all kept
            for d, q in enumerate(laws):
                row = target[t + d]  # the target's law for the token at t + d + 1
                full = q if ids_of is None else row.new_zeros(row.shape).index_put_((ids_of,), q)  # [V]
                keeps = sibling_keeps(row, full, width, generator)
                for w, kept in enumerate(keeps):
                    totals[w][d] += reach * kept
                reach *= keeps[0]
                counts[d] += 1
            if lookup is not None:
                copied = lookup.propose(state).tokens[1:].tolist()
                found += bool(copied)
                steps += 1
                first = laws[0] if ids_of is None else laws[0].new_zeros(target.shape[-1]).index_put_((ids_of,), laws[0])
                for i, gain in enumerate(chain_gains(copied, ids, t, target, first, chain)):
                    gains[i] += gain
            outcome = StepOutcome(nodes=[0], tokens=[ids[t + 1]], hidden=hidden[t: t + 1], start=t)
            state.length, state.root = t + 1, seq[t + 1]
            state.tokens.append(ids[t + 1])
            proposer.update(state, outcome)
    curves = [tuple(sum(row[j] / max(counts[j], 1) for j in range(d + 1)) for d in range(depth)) for row in totals]
    return DrawnCurve(temperature, curves[0], seconds / max(levels, 1) * 1e3, tuple(g / max(steps, 1) for g in gains),
                      found / max(steps, 1), tuple(curves[1:]))


def sibling_keeps(p: torch.Tensor, q: torch.Tensor, width: int, generator: torch.Generator | None = None,
                  draws: int = SIBLING_DRAWS) -> list[float]:
    """The chance verification keeps one of the first ``1..width`` siblings drawn without
    replacement from ``q`` ``[V]`` against the target's ``p`` ``[V]`` (verify_sampled's rule).
    The first is kept with ``sum min(p, q)``; past it, each sibling's chance depends on the
    rejected ones, drawn here ``draws`` times from their law given the rejection,
    ``max(q_j - r_j, 0)`` (an unbiased average)."""
    first = torch.minimum(p, q).sum().item()
    if width == 1:
        return [first]
    totals = [0.0] * (width - 1)
    for _ in range(draws):
        kept, missed, r, law = first, 1.0 - first, p, q
        for j in range(width - 1):
            rejected = (law - r).clamp(min=0)  # [V] the law of sibling j given it was rejected
            left = (r - law).clamp(min=0)
            rest = None if missed <= 1e-9 or rejected.sum() <= 0 or left.sum() <= 0 else \
                law.index_fill(0, torch.multinomial(rejected, 1, generator=generator), 0.0)
            if rest is None or rest.sum() <= 0:
                totals[j:] = [total + kept for total in totals[j:]]  # nothing left to keep
                break
            r, law = left / left.sum(), rest / rest.sum()
            beta = torch.minimum(r, law).sum().item()
            kept, missed = kept + missed * beta, missed * (1.0 - beta)
            totals[j] += kept
    return [first] + [total / draws for total in totals]


def chain_gains(copied: list[int], ids: list[int], t: int, target: torch.Tensor, first: torch.Tensor,
                chain: int) -> list[float]:
    """Tokens a point-mass chain ``copied`` adds beside a drawn first token of law ``first``
    ``[V]`` at position ``t`` of ``ids`` (``target[t + j]``: the target's law of token ``t + j + 1``),
    for chains cut to 1..``chain`` tokens: its first token kept from the residual law, the next
    ones while the chain matches the answer (where it does not, the target's law of the next
    token is unknown: counted as rejected)."""
    out, total, kept = [], 0.0, 0.0
    for j, token in enumerate(copied[:chain]):
        if j == 0:
            kept = max(target[t, token].item() - first[token].item(), 0.0)
        elif t + j < len(ids) and ids[t + j] == copied[j - 1]:
            kept *= target[t + j, token].item()
        else:
            kept = 0.0
        total += kept
        out.append(total)
    return out + [total] * (chain - len(out))


def sampled_answers(engine, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                    seed: int) -> list[list[int]]:
    """The target's answers sampled at ``temperature`` (plain decoding, prompt ``i`` seeded
    ``seed + i``): the text drawn chains are verified on at that temperature."""
    return [engine.generate(p, max_new_tokens=max_new_tokens, mode="baseline", temperature=temperature,
                            seed=seed + i).tokens
            for i, p in enumerate(tqdm(prompts, desc=f"target answers at T={temperature}", file=sys.stderr))]


def calibrate_drawn(engine, prompts: list[list[int]], temperatures: list[float], max_new_tokens: int,
                    seed: int, chain: int = 8, width: int = 1) -> dict[str, dict]:
    """Per temperature, the drawn chains' curve (and levels of up to ``width`` siblings) on
    answers sampled at it (calibration.json's ``drawn``), each printed in one line."""
    out: dict[str, dict] = {}
    if not hasattr(kind(engine.heads.config.kind).proposer_class(), "chain_laws"):
        print(f"{engine.heads.config.kind} heads draft no drawn chains: no temperature calibration")
        return out
    for temperature in temperatures:
        answers = sampled_answers(engine, prompts, max_new_tokens, temperature, seed)
        pairs = [(p, a) for p, a in zip(prompts, answers) if a]
        with engine.kernel_scope():
            curve = drawn_curve(engine.heads, engine.model, pairs, temperature, chain=chain,
                                lookup_ngram=engine.proposer_config.lookup_ngram, width=width, seed=seed)
        print(f"T={temperature:g}: drafted tokens kept by a drawn chain of depth 1..{len(curve.kept)}: "
              + ", ".join(f"{k:.2f}" for k in curve.kept) + f"; {curve.level_ms:.2f} ms a level; a lookup chain "
              f"of 1..{chain} tokens beside it adds " + ", ".join(f"{g:.3f}" for g in curve.chain)
              + f" ({curve.chain_share:.0%} of steps)" + "".join(
                  f"; {w} siblings a depth: " + ", ".join(f"{k:.2f}" for k in kept) for w, kept in curve.by_width()[1:]))
        out[f"{temperature:g}"] = curve.as_record()
    return out


def best_depth(curve: DrawnCurve, cost_ms: dict[int, float]) -> int:
    """The chain depth with the most expected tokens per second (0: plain decoding pays more)."""
    return best_size(curve, cost_ms, hybrid=False)[0]


def best_size(curve: DrawnCurve, cost_ms: dict[int, float], hybrid: bool = True) -> tuple[int, int, int]:
    """``(depth, chain, width)``: the drawn levels' depth and siblings a level and, for mode hybrid
    (where the curve measured it), the lookup chain's length, with the most expected tokens per
    second (0, 0, 1: plain decoding). The lookup chain was measured beside one drawn sibling: it
    is sized with chains only."""
    best, rate = (0, 0, 1), 1.0 / cost_ms[min(cost_ms)]
    share = curve.chain_share
    for width, kept_by_depth in curve.by_width():
        chains = (0.0,) + (curve.chain if hybrid and width == 1 else ())
        for depth, kept in enumerate((0.0,) + kept_by_depth):
            for length, gain in enumerate(chains):
                if depth == 0 and (length or width > 1):
                    continue  # (a chain alone is mode lookup)
                rows = 1 + depth * width
                ms = ((1 - share) * interpolate(cost_ms, rows) + share * interpolate(cost_ms, rows + length)
                      + depth * curve.level_ms)
                if (1.0 + kept + gain) / ms > rate * (1 + 1e-9):
                    best, rate = (depth, length, width), (1.0 + kept + gain) / ms
    return best


def drawn_depths(records: dict | None, cost_ms: dict[int, float],
                 hybrid: bool = False) -> tuple[tuple[float, DynamicTree], ...]:
    """Per calibrated temperature, the drawn levels a sampled request drafts (a ``DynamicTree``
    ``depth`` deep with ``topk`` siblings a depth, ``nodes`` their number; 0 nodes: none) and in
    mode hybrid (``hybrid``) the lookup chain beside them (``chain``), from ``records`` (the heads'
    calibration ``drawn``: temperature -> record) and this machine's pass costs ``cost_ms``."""
    sizes = []
    for temperature, record in sorted((records or {}).items(), key=lambda item: float(item[0])):
        depth, chain, width = best_size(DrawnCurve.from_record(float(temperature), record), cost_ms, hybrid)
        sizes.append((float(temperature), DynamicTree(nodes=depth * width, depth=max(depth, 1), topk=width,
                                                      chain=chain)))
    return tuple(sizes)


def drawn_table(records: dict | None, cost_ms: dict[int, float]) -> tuple:
    """``Plan.drawn``: per calibrated temperature, mode eagle's drawn chain and mode hybrid's with
    its lookup chain, ``((temperature, eagle, hybrid), ...)``."""
    return tuple((t, eagle, hybrid) for (t, eagle), (_, hybrid)
                 in zip(drawn_depths(records, cost_ms), drawn_depths(records, cost_ms, hybrid=True)))


def drawn_records(heads, device: torch.device, dtype: torch.dtype) -> dict | None:
    """The heads' drawn calibration (temperature -> record): the entry for this device and dtype
    first, else any entry that has one (None: never calibrated at a temperature)."""
    entry = _drawn_entry(heads, device, dtype)
    return None if entry is None else entry["drawn"]


def calibrated_drawn(heads, device: torch.device, dtype: torch.dtype, cost_ms: dict[int, float] | None = None) -> tuple:
    """``Plan.drawn`` for heads whose trees are calibrated, not sized here (Medusa's static trees):
    the drawn chains per temperature from this machine's pass costs ``cost_ms`` (the kernel pick's
    timing), else the calibrated entry's own (``()``: no drawn calibration)."""
    entry = _drawn_entry(heads, device, dtype)
    if entry is None or not (cost_ms or entry.get("cost_ms")):
        return ()
    return drawn_table(entry["drawn"], cost_ms or {int(n): float(ms) for n, ms in entry["cost_ms"].items()})


def _drawn_entry(heads, device: torch.device, dtype: torch.dtype) -> dict | None:
    measured = getattr(heads, "measured", None) or {}
    keys = [tree_key(device.type, dtype), device.type] + sorted(measured)
    return next((measured[k] for k in keys if isinstance(measured.get(k), dict) and measured[k].get("drawn")), None)


def describe_drawn(drawn: tuple, own: str = "eagle") -> str:
    """``Plan.drawn`` in words, for the trees decision (empty where none); ``own``: the heads' mode."""
    return "".join(f"; sampled at T={t:g}: {own} {drawn_shape(eagle)}, hybrid {drawn_shape(hybrid)} and a "
                   f"{hybrid.chain}-token lookup chain" for t, eagle, hybrid in drawn)


def drawn_shape(size: DynamicTree) -> str:
    """A drawn size in words: ``"a 3-deep drawn chain"`` or ``"a 2-deep drawn tree, 2 a depth"``."""
    depth = size.nodes // max(size.topk, 1)
    return f"a {depth}-deep drawn chain" if size.topk <= 1 else f"a {depth}-deep drawn tree, {size.topk} a depth"
