"""Drawn chains calibrated at a temperature: how deep EAGLE heads draft a sampled request.

A sampled request's heads draw a chain from their processed distribution ``q`` and verification
keeps each drawn token with probability ``min(1, p/q)`` (medusa/decoding/proposers/drawn.py), so
the chance that depth ``d`` is kept, once its parent was, is ``beta_d = sum_v min(p_d(v), q_d(v))``.
Greedy calibration (:func:`medusa.autotune.trees.acceptance_by_size`) cannot say how deep that
pays: ``beta`` falls as the temperature spreads ``p``. This module measures it: along the target's
own answers sampled at the temperature (teacher-forced, the answer's tokens standing for the
drawn ones), at every position it takes the head's laws down a chain and the target's ``p`` at
the same positions, and averages the expected drafted tokens kept by a chain of each depth,
``E(D) = sum_{d<=D} prod_{j<=d} beta_j``. ``scripts/calibrate_tree.py --temperatures`` writes
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
from medusa.decoding.sampling import SamplingConfig, probabilities
from medusa.decoding.state import DecodeState, StepOutcome
from medusa.decoding.tree import tree_key
from medusa.models.kinds import kind
from medusa.runtime import hf as kv

MAX_DEPTH = 8  # the deepest drawn chain calibrated


@dataclass(frozen=True)
class DrawnCurve:
    """Expected drafted tokens kept by a drawn chain of depth 1..len(kept), and a level's ms."""

    temperature: float
    kept: tuple[float, ...]
    level_ms: float

    def as_record(self) -> dict:
        return {"kept": [round(k, 4) for k in self.kept], "level_ms": round(self.level_ms, 4)}

    @classmethod
    def from_record(cls, temperature: float, record: dict) -> DrawnCurve:
        return cls(float(temperature), tuple(float(k) for k in record["kept"]), float(record["level_ms"]))


def drawn_curve(heads, model, sequences: list[tuple[list[int], list[int]]], temperature: float,
                depth: int = MAX_DEPTH, top_p: float = 1.0) -> DrawnCurve:
    """:class:`DrawnCurve` along ``(prompt, answer)`` token lists (answers the target sampled at
    ``temperature``), the heads drafting as the engine's proposer does."""
    device = heads.fc.weight.device
    size = DynamicTree(nodes=depth, depth=depth, topk=1)  # (the calibrated size may draft nothing)
    proposer = kind(heads.config.kind).proposer_class().for_heads(heads, device, size=size)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p)
    totals, counts, seconds, levels = [0.0] * depth, [0] * depth, 0.0, 0
    ids_of = heads.draft_vocab
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
        for t in range(p, len(ids) - 1):
            chain = ids[t + 1: t + 1 + depth]
            t0 = time.perf_counter()
            laws = proposer.chain_laws(state, chain)  # [S] each, over the draft vocabulary
            seconds += time.perf_counter() - t0
            levels += len(laws)
            kept = 1.0
            for d, q in enumerate(laws):
                row = target[t + d]  # the target's law for the token at t + d + 1
                beta = torch.minimum(row if ids_of is None else row[ids_of], q).sum().item()
                kept *= beta
                totals[d] += kept
                counts[d] += 1
            outcome = StepOutcome(nodes=[0], tokens=[ids[t + 1]], hidden=hidden[t: t + 1], start=t)
            state.length, state.root = t + 1, seq[t + 1]
            state.tokens.append(ids[t + 1])
            proposer.update(state, outcome)
    per_depth = [totals[d] / max(counts[d], 1) for d in range(depth)]
    kept = tuple(sum(per_depth[: d + 1]) for d in range(depth))
    return DrawnCurve(temperature, kept, seconds / max(levels, 1) * 1e3)


def sampled_answers(engine, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                    seed: int) -> list[list[int]]:
    """The target's answers sampled at ``temperature`` (plain decoding, prompt ``i`` seeded
    ``seed + i``): the text drawn chains are verified on at that temperature."""
    return [engine.generate(p, max_new_tokens=max_new_tokens, mode="baseline", temperature=temperature,
                            seed=seed + i).tokens
            for i, p in enumerate(tqdm(prompts, desc=f"target answers at T={temperature}", file=sys.stderr))]


def calibrate_drawn(engine, prompts: list[list[int]], temperatures: list[float], max_new_tokens: int,
                    seed: int) -> dict[str, dict]:
    """Per temperature, the drawn chains' curve on answers sampled at it (calibration.json's
    ``drawn``), each printed in one line."""
    out: dict[str, dict] = {}
    if not hasattr(kind(engine.heads.config.kind).proposer_class(), "chain_laws"):
        print(f"{engine.heads.config.kind} heads draft no drawn chains: no temperature calibration")
        return out
    for temperature in temperatures:
        answers = sampled_answers(engine, prompts, max_new_tokens, temperature, seed)
        pairs = [(p, a) for p, a in zip(prompts, answers) if a]
        with engine.kernel_scope():
            curve = drawn_curve(engine.heads, engine.model, pairs, temperature)
        print(f"T={temperature:g}: drafted tokens kept by a drawn chain of depth 1..{len(curve.kept)}: "
              + ", ".join(f"{k:.2f}" for k in curve.kept) + f"; {curve.level_ms:.2f} ms a level")
        out[f"{temperature:g}"] = curve.as_record()
    return out


def best_depth(curve: DrawnCurve, cost_ms: dict[int, float]) -> int:
    """The chain depth with the most expected tokens per second (0: plain decoding pays more)."""
    best, rate = 0, 1.0 / cost_ms[min(cost_ms)]
    for depth, kept in enumerate(curve.kept, start=1):
        ms = interpolate(cost_ms, 1 + depth) + depth * curve.level_ms
        if (1.0 + kept) / ms > rate * (1 + 1e-9):
            best, rate = depth, (1.0 + kept) / ms
    return best


def drawn_depths(records: dict | None, cost_ms: dict[int, float], draw: int = 1) -> tuple[tuple[float, DynamicTree], ...]:
    """Per calibrated temperature, the drawn chain a sampled request drafts (a ``DynamicTree`` of
    ``depth * draw`` nodes, ``depth`` deep; 0 nodes: plain decoding), from ``records`` (the heads'
    calibration ``drawn``: temperature -> record) and this machine's pass costs ``cost_ms``."""
    sizes = []
    for temperature, record in sorted((records or {}).items(), key=lambda item: float(item[0])):
        depth = best_depth(DrawnCurve.from_record(float(temperature), record), cost_ms)
        sizes.append((float(temperature), DynamicTree(nodes=depth * max(draw, 1), depth=max(depth, 1), topk=1)))
    return tuple(sizes)


def drawn_records(heads, device: torch.device, dtype: torch.dtype) -> dict | None:
    """The heads' drawn calibration (temperature -> record): the entry for this device and dtype
    first, else any entry that has one (None: never calibrated at a temperature)."""
    measured = getattr(heads, "measured", None) or {}
    keys = [tree_key(device.type, dtype), device.type] + sorted(measured)
    return next((measured[k]["drawn"] for k in keys if isinstance(measured.get(k), dict) and measured[k].get("drawn")),
                None)
