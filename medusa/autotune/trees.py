"""Calibrate a candidate tree to a set of heads and a device.

The best tree maximises expected accepted tokens per second, not per step: a bigger tree
accepts more per target pass but each pass costs more, and how much more depends on the
device (a 64-node pass costs about one single-token pass on a GPU, several on a CPU: docs/trees.md).

Inputs, both measured: how often each candidate path of the heads is right on the
target's own greedy output (``path_counts``), and the target's pass cost ``T(n)`` for ``n``
new tokens (:func:`medusa.autotune.timing.measure_cost`). ``choose_tree`` then picks the nodes greedily by empirical
acceptance (which is prefix-closed, so every prefix is a valid tree) and keeps the size with
the best ``E[accepted] / T(nodes)``.

EAGLE heads' dynamic trees are calibrated from their teacher-forced acceptance per draft
shape (:func:`acceptance_by_size`, decoding with a lookup chain replayed by
:func:`simulate`) and the same pass cost (:func:`choose_dynamic`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.proposers.lookup import PromptLookup
from medusa.decoding.state import DecodeState, StepOutcome
from medusa.decoding.tree import spelled
from medusa.models.eagle_heads import EagleHeads
from medusa.models.heads import MedusaHeads
from medusa.models.kinds import kind
from medusa.runtime import hf as kv

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


@dataclass
class Acceptance:
    """Teacher-forced acceptance of one draft shape (see :func:`acceptance_by_size`)."""

    accepted: list[float]  # [N - 1] mean draft tokens accepted per position with the N best nodes, N = 1..nodes
    draft_ms: float  # mean milliseconds of a step's drafting
    # with a lookup chain (mode hybrid), decoding simulated along the answers: [L][N] mean draft
    # tokens accepted per step with an L-token chain beside the N best nodes (L = 0..chain,
    # N = 0..nodes; L = 0 is mode eagle), [L][N] the share of those steps whose chain adds rows
    # to the pass (prompt lookup or the n-gram table drafted tokens the tree does not hold), and
    # [L][N] the mean rows it adds in those steps (the chain shares the nodes the tree drafted too)
    hybrid: list[list[float]] | None = None
    chain_share: list[list[float]] | None = None
    chain_rows: list[list[float]] | None = None

    def as_record(self) -> dict:
        """For calibration.json (rounded: four decimals are far below the sampling noise)."""
        record = {"accepted": _rounded(self.accepted), "draft_ms": round(self.draft_ms, 4)}
        if self.hybrid is not None:
            record.update(hybrid=_rounded(self.hybrid), chain_share=_rounded(self.chain_share))
        if self.chain_rows is not None:
            record.update(chain_rows=_rounded(self.chain_rows))
        return record

    @classmethod
    def from_record(cls, record: dict) -> Acceptance:
        return cls(list(record["accepted"]), float(record["draft_ms"]), record.get("hybrid"), record.get("chain_share"),
                   record.get("chain_rows"))

    def rows_added(self, length: int, nodes: int) -> float:
        """Mean rows an L-token chain adds to a pass with the N best nodes, in the steps where it
        adds any (files calibrated before chains shared nodes: all L)."""
        return float(length) if self.chain_rows is None else self.chain_rows[length][nodes]


def _rounded(values):
    return [_rounded(v) for v in values] if isinstance(values, list) else round(values, 4)


def simulate(positions: list[list[tuple]], nodes: int, chain: int,
             ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Decoding replayed on teacher-forced drafts: ``positions`` holds, per answer and answer
    position, ``(right, hits, rows[, along])``: the draft tokens the N best nodes get right
    (N = 0..nodes), the chain tokens that are right, the chain's length and, optionally, the
    best-first ranks of the draft nodes that spell the chain's first tokens (increasing: a
    parent ranks before its children). A step at position i accepts a = max(right[N],
    min(hits, L)) drafts and the next step starts at i + a + 1, as in decoding (a plain average
    over positions would count every position inside a long copied span as its own step). The
    chain shares the nodes of ``along`` that the N best keep (mode hybrid lays out only the
    rest: proposers.Hybrid). Returns ([L][N] mean drafts accepted per step, [L][N] share of
    steps whose chain adds rows, [L][N] mean rows it adds in those steps)."""
    accepted = [[0.0] * (nodes + 1) for _ in range(chain + 1)]
    share = [[0.0] * (nodes + 1) for _ in range(chain + 1)]
    added = [[float(length)] * (nodes + 1) for length in range(chain + 1)]
    for length in range(chain + 1):
        for n in range(nodes + 1):
            steps = total = with_chain = rows_added = 0
            for answer in positions:
                i = 0
                while i < len(answer):
                    right, hits, rows, *along = answer[i]
                    a = max(right[n], min(hits, length))
                    used = min(rows, length)
                    extra = used - sum(1 for rank in (along[0][:used] if along else ()) if rank < n)
                    steps, total = steps + 1, total + a
                    if extra > 0:
                        with_chain, rows_added = with_chain + 1, rows_added + extra
                    i += a + 1
            accepted[length][n] = total / max(steps, 1)
            share[length][n] = with_chain / max(steps, 1)
            if with_chain:
                added[length][n] = rows_added / with_chain
    return accepted, share, added


@torch.inference_mode()
def acceptance_by_size(heads: EagleHeads, model, sequences: list[tuple[list[int], list[int]]],
                       size: DynamicTree, chain: int = 0, lookup_ngram: int = 3, window: int | None = None) -> Acceptance:
    """Teacher-forced along the target's own answers (``(prompt, answer)`` token lists): for
    every ``N`` in ``1..size.nodes``, the mean draft tokens accepted per position when the
    target verifies the ``N`` best nodes (one drafting per position serves every ``N``: the
    best-N sets are nested); and the mean milliseconds the drafting of a step takes. With
    ``chain``, prompt lookup (``lookup_ngram``) copies up to ``chain`` tokens at each position
    too, and decoding with a chain of every length up to it beside the N best nodes is replayed
    (:func:`simulate`; chain length 0 is mode eagle). ``window``: the pairs the head attends to
    at most, as the engine drafts (``ProposerConfig.draft_window``; it matters past that many)."""
    device = heads.fc.weight.device
    # block heads (medusa.decoding.proposers.block) read the same features, rank their nodes alike
    proposer = kind(heads.config.kind).proposer_class().for_heads(heads, device, size=size, window=window)
    # the chain as mode hybrid drafts it: prompt lookup, else the heads' n-gram table
    lookup = PromptLookup(device, num_tokens=chain, max_ngram=lookup_ngram, table=heads.ngrams) if chain else None
    totals = [0] * (size.nodes + 1)
    positions: list[list[tuple[list[int], int, int, list[int]]]] = []
    steps, seconds = 0, 0.0
    for prompt, answer in sequences:
        ids = prompt + answer
        seq = torch.tensor(ids, device=device)
        hidden = kv.features(model, seq, getattr(heads, "feature_layers", None))  # [T, H] (eagle3: [T, L*H])
        p = len(prompt)
        state = DecodeState(cache=None, tokens=ids[: p + 1], length=p, root=seq[p], hidden=hidden[p - 1],
                            logits=None, prefill_hidden=hidden[:p])
        proposer.begin(state)
        if lookup is not None:
            lookup.begin(state)
        positions.append([])
        for t in range(p, len(ids) - 1):
            t0 = time.perf_counter()
            proposal = proposer.propose(state)
            seconds += time.perf_counter() - t0
            tokens = dict(zip(proposal.tree.paths, proposal.tokens[1:].tolist()))
            right: set[Path_] = set()
            best, by_size = 0, [0]
            for path in proposer.ranked:
                d = len(path)
                if (d == 1 or path[:-1] in right) and t + d < len(ids) and tokens[path] == ids[t + d]:
                    right.add(path)
                    best = max(best, d)
                by_size.append(best)
            by_size += [best] * (size.nodes + 1 - len(by_size))
            totals = [total + right_n for total, right_n in zip(totals, by_size)]  # by_size[0] is 0
            copied = [] if lookup is None else lookup.propose(state).tokens[1:].tolist()
            hits = next((i for i, tok in enumerate(copied) if t + 1 + i >= len(ids) or tok != ids[t + 1 + i]),
                        len(copied))
            along = spelled(proposer.ranked, map(tokens.get, proposer.ranked), copied)  # the draft's nodes it starts with
            positions[-1].append((by_size, hits, len(copied), [proposer.ranked.index(node) for node in along]))
            steps += 1
            # advance by the one true token, as a step that accepted nothing would
            outcome = StepOutcome(nodes=[0], tokens=[ids[t + 1]], hidden=hidden[t: t + 1], start=t)
            state.length, state.root = t + 1, seq[t + 1]
            state.tokens.append(ids[t + 1])
            proposer.update(state, outcome)
    steps = max(steps, 1)
    result = Acceptance([totals[n] / steps for n in range(1, size.nodes + 1)], seconds / steps * 1e3)
    if lookup is not None:
        result.hybrid, result.chain_share, result.chain_rows = simulate(positions, size.nodes, chain)
    return result


def shallower(curves: dict[tuple[int, int], Acceptance]) -> dict[tuple[int, int], Acceptance]:
    """``curves`` with, for each draft shape ``(depth, topk)``, the shallower shapes ``(d, topk)``,
    ``d < depth``, sized up to ``d`` nodes: the best ``n`` nodes of a draft, prefix-closed, lie
    within its first ``n`` levels, and those levels are the same in both shapes, so ``n <= d``
    nodes keep exactly what the deeper shape's ``n`` best keep, while drafting ``d`` levels costs
    less than drafting ``depth`` (a shape's drafting is timed by the planner). A shape calibrated
    itself keeps its own curve."""
    out = dict(curves)
    for (depth, topk), acc in sorted(curves.items()):
        for d in range(1, depth):
            if (d, topk) in out:
                continue

            def cut(table, d=d):  # per chain length, N = 0..d nodes
                return None if table is None else [row[: d + 1] for row in table]

            out[(d, topk)] = Acceptance(acc.accepted[:d], acc.draft_ms, cut(acc.hybrid), cut(acc.chain_share),
                                        cut(acc.chain_rows))
    return out


def choose_dynamic(curves: dict[tuple[int, int], Acceptance], cost_ms: dict[int, float], hybrid: bool = False,
                   max_rows: int | None = None, within: DynamicTree | None = None) -> tuple[DynamicTree, float, float]:
    """The tree size with the most expected tokens per second, from the acceptance of each
    ``(depth, topk)`` draft shape and the target's pass cost ``T(n)``; ``nodes=0`` (plain
    decoding) when no size beats it. Curves with replayed decoding (:func:`simulate`) are
    read from it, older ones from the per-position average. ``hybrid``: the size for mode
    hybrid, the lookup chain's length (``chain``) chosen with it from the replay, the rows it
    adds beyond the nodes it shares with the tree paid in the steps where it adds any (older
    curves are sized without a chain). ``max_rows``: the
    largest pass the engine verifies (root, nodes and chain). ``within``: only sizes a proposer
    built for it can switch to per step (the context-length sizing, medusa/autotune/sizing.py):
    its draft shape's ``topk``, no deeper, no more nodes, no longer a chain. Returns the size, its
    expected tokens per pass and its tokens per second."""
    simulated = all(acc.hybrid is not None for acc in curves.values())
    chains = hybrid and simulated
    best = (DynamicTree(nodes=0, depth=1, topk=1, chain=0 if chains else None), 1.0, 1e3 / cost_ms[1])
    for (depth, topk), acc in sorted(curves.items()):
        if within is not None and within.nodes and (topk != within.topk or depth > within.depth):
            continue
        if simulated:  # decoding replayed (mode eagle: the chain of length 0)
            tables, shares = (acc.hybrid, acc.chain_share) if chains else (acc.hybrid[:1], acc.chain_share[:1])
        else:
            tables, shares = [[0.0] + acc.accepted], [[0.0] * (len(acc.accepted) + 1)]
        for length, (table, share) in enumerate(zip(tables, shares)):
            for n, accepted in enumerate(table):
                if max_rows is not None and 1 + n + length > max_rows:
                    break
                if within is not None and (n > within.nodes or length > (within.chain or 0)):
                    continue
                rows = acc.rows_added(length, n) if chains else 0.0
                ms = (1 - share[n]) * interpolate(cost_ms, 1 + n) + share[n] * interpolate(cost_ms, 1 + n + rows)
                ms += acc.draft_ms if n else 0.0
                tps = (1.0 + accepted) / ms * 1e3
                if tps > best[2] * (1 + 1e-9):
                    chain = length if chains else None
                    best = (DynamicTree(nodes=n, depth=depth, topk=topk, chain=chain), 1.0 + accepted, tps)
    return best
