"""Calibrate a candidate tree to a set of heads and a device.

The best tree maximises expected accepted tokens per second, not per step: a bigger tree
accepts more per target pass but each pass costs more, and how much more depends on the
device (a 64-node pass costs about one single-token pass on a GPU, four on a 2-core CPU).

Inputs, both measured: how often each candidate path of the heads is right on the
target's own greedy output (``path_counts``), and the target's pass cost ``T(n)`` for ``n``
new tokens (``measure_cost``). ``choose_tree`` then picks the nodes greedily by empirical
acceptance (which is prefix-closed, so every prefix is a valid tree) and keeps the size with
the best ``E[accepted] / T(nodes)``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from medusa.decoding import hf as kv
from medusa.decoding.tree import compile_tree
from medusa.models.heads import MedusaHeads

Path_ = tuple[int, ...]


def candidate_ranks(heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor, max_rank: int) -> torch.Tensor:
    """``[T, K]`` rank of the right token in each head's candidates, -1 when beyond ``max_rank``.

    ``hidden`` ``[T, H]`` are the target's final hidden states over a sequence whose tokens
    are ``tokens`` ``[T]``; head ``k`` at position ``t`` should propose ``tokens[t + k + 2]``.
    Positions too close to the end for any head are dropped. Ranks are taken in the draft
    vocabulary when the heads have one (a token outside it can never be proposed).
    """
    k_heads = heads.num_heads
    n = tokens.numel() - k_heads - 1
    if n <= 0:
        return torch.empty(0, k_heads, dtype=torch.long)
    ranks = torch.full((n, k_heads), -1, dtype=torch.long)
    for k in range(k_heads):
        truth = tokens[k + 2: k + 2 + n]  # [n]
        logits = heads.logits(hidden[:n], [k], heads.draft_vocab)[0]  # [n, S or V]
        if heads.draft_vocab is not None:
            where = (heads.draft_vocab.to(hidden.device)[None, :] == truth[:, None])  # [n, S]
            inside = where.any(dim=1)
            true_logit = torch.where(inside, (logits * where).sum(dim=1), torch.full_like(truth, 0, dtype=logits.dtype))
        else:
            inside = torch.ones_like(truth, dtype=torch.bool)
            true_logit = logits.gather(1, truth[:, None])[:, 0]
        rank = (logits > true_logit[:, None]).sum(dim=1)  # [n]
        ok = inside & (rank < max_rank)
        ranks[:, k] = torch.where(ok, rank, torch.full_like(rank, -1)).cpu()
    return ranks


def path_counts(ranks: torch.Tensor) -> Counter:
    """How many positions accept each candidate path: position ``t`` accepts every prefix of
    its rank sequence up to the first head that missed."""
    counts: Counter = Counter()
    for row in ranks.tolist():
        path: Path_ = ()
        for r in row:
            if r < 0:
                break
            path = path + (r,)
            counts[path] += 1
    return counts


@dataclass(frozen=True)
class TreeChoice:
    paths: list[Path_]
    expected_tokens: float  # per target pass, bonus token included
    step_ms: float
    tokens_per_second: float
    curve: list[tuple[int, float, float]]  # (nodes incl. root, expected tokens, tokens/s)


def interpolate(cost_ms: dict[int, float], n: int) -> float:
    """Piecewise-linear ``T(n)`` from measured points (flat beyond the ends)."""
    xs = sorted(cost_ms)
    if n <= xs[0]:
        return cost_ms[xs[0]]
    if n >= xs[-1]:
        return cost_ms[xs[-1]] * n / xs[-1]
    for a, b in zip(xs, xs[1:]):
        if a <= n <= b:
            return cost_ms[a] + (cost_ms[b] - cost_ms[a]) * (n - a) / (b - a)
    raise AssertionError("unreachable")


def choose_tree(counts: Counter, positions: int, cost_ms: dict[int, float], max_nodes: int) -> TreeChoice:
    """The tree (up to ``max_nodes`` candidates) with the most expected tokens per second."""
    ranked = sorted(counts.items(), key=lambda kv_: (-kv_[1], len(kv_[0]), kv_[0]))
    best: TreeChoice | None = None
    chosen: list[Path_] = []
    have: set[Path_] = set()
    accepted = 0
    curve = []
    for n in range(0, min(max_nodes, len(ranked)) + 1):
        if n > 0:
            path, c = ranked[n - 1]
            if len(path) > 1 and path[:-1] not in have:  # ties can order a child first; skip it
                continue
            chosen.append(path)
            have.add(path)
            accepted += c
        expected = 1.0 + accepted / max(positions, 1)
        ms = interpolate(cost_ms, len(chosen) + 1)
        tps = expected / ms * 1e3
        curve.append((len(chosen) + 1, expected, tps))
        if best is None or tps > best.tokens_per_second:
            best = TreeChoice(paths=list(chosen), expected_tokens=expected, step_ms=ms, tokens_per_second=tps, curve=[])
    assert best is not None
    return TreeChoice(best.paths, best.expected_tokens, best.step_ms, best.tokens_per_second, curve)


@torch.inference_mode()
def measure_cost(model: PreTrainedModel, sizes: list[int], prefix: int = 256, reps: int = 9,
                 static_cache: bool = False, compile: bool | str = False) -> dict[int, float]:
    """Median milliseconds of one target pass over ``n`` new tree nodes after ``prefix``
    cached tokens, for each ``n`` in ``sizes`` (a star-shaped tree: cost depends on n only).

    Sizes are timed round-robin (``reps`` rounds after a warm-up round), so a slow spell of
    the machine spreads over every size instead of inflating one of them. ``static_cache``
    and ``compile`` time the pass as an engine built with them runs it (compiled in the
    warm-up round).
    """
    return measure_costs({"": (model, contextlib.nullcontext())}, sizes, prefix, reps, static_cache, compile)[""]


def measure_costs(variants: dict[str, tuple[PreTrainedModel, contextlib.AbstractContextManager]], sizes: list[int],
                  prefix: int = 256, reps: int = 9, static_cache: bool = False,
                  compile: bool | str = False) -> dict[str, dict[int, float]]:
    """:func:`measure_cost` for several ``(model, scope)`` variants (a model in two dtypes, one
    model with two kernel scopes), each pass run inside its variant's (re-entrant) scope, timed round-robin
    over variants and sizes: a slow spell of the machine (a VM's speed drifts by half within
    minutes) then falls on every variant alike instead of deciding a comparison."""
    runs = {name: _pass_timer(model, scope, sizes, prefix, static_cache, compile)
            for name, (model, scope) in variants.items()}
    samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in variants}
    for _ in range(reps + 1):
        for name, run in runs.items():
            for n in sizes:
                samples[name][n].append(run(n))
    return {name: {n: statistics.median(s[1:]) * 1e3 for n, s in by_n.items()} for name, by_n in samples.items()}


def _pass_timer(model: PreTrainedModel, scope: contextlib.AbstractContextManager, sizes: list[int], prefix: int,
                static_cache: bool, compile: bool | str):
    """A function timing one pass of ``n`` new nodes (seconds) after ``prefix`` cached tokens."""
    device = model.get_output_embeddings().weight.device
    vocab = model.config.vocab_size
    static = bool(static_cache or compile)
    forward = kv.compiled_forward(device, compile) if compile else kv.forward
    cache = kv.new_static_cache(model, prefix + max(sizes)) if static else kv.new_cache()
    width = kv.capacity(cache)
    ids = torch.randint(0, vocab, (1, prefix), device=device)
    mask = kv.causal_mask(model, 0, prefix, model.dtype, device, width) if static else None
    with scope:
        kv.forward(model, ids, torch.arange(prefix, device=device)[None], cache, mask, logits_rows=slice(-1, None))
    setups = {}
    for n in sizes:
        tree = compile_tree([(i,) for i in range(n - 1)]).to(device)
        setups[n] = (tree, torch.randint(0, vocab, (1, n), device=device), (prefix + tree.depth)[None])

    def run(n: int) -> float:
        tree, tokens, positions = setups[n]
        with scope:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if static or n > 1:
                mask = kv.tree_attention_mask(model, prefix, tree.ancestor, tree.depth, model.dtype, width)
            else:
                mask = None
            logits, _ = forward(model, tokens, positions, cache, mask)
            logits.argmax(-1).tolist()  # the step's host sync
            seconds = time.perf_counter() - t0
            kv.crop(cache, prefix)
        return seconds

    return run


def tree_key(device_type: str, dtype: torch.dtype) -> str:
    """The key of a calibrated tree in calibration.json: the pass cost, hence the best tree,
    depends on the device and the dtype. float32 keeps the bare device type (files written
    before dtypes were told apart); other dtypes add theirs, e.g. ``"cpu-bfloat16"``."""
    return device_type if dtype == torch.float32 else f"{device_type}-{str(dtype).removeprefix('torch.')}"
