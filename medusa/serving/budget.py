"""How many rows a batched pass verifies, and how they are shared between the sequences.

A pass costs about the same for 1 row as for a dozen while the weights, not the arithmetic, bound
it (a CPU's gemv kernels, a GPU at small batch); past that knee every row costs more. So a batch
of B sequences gets a budget of ``max(B, knee)`` rows: each sequence its root, and drafts only in
the rows that still cost about one pass. The trees shrink as the batch grows, and at B >= knee
nothing is drafted: speculation turns itself off where the pass is compute-bound.
"""

from __future__ import annotations

from collections.abc import Sequence

KNEE_RATIO = 1.5  # rows cost "about one pass" while T(n) <= 1.5 T(1)
DEFAULT_KNEE = {"cpu": 12, "cuda": 64}  # where the plan measured no pass costs


def knee(pass_ms: Sequence[tuple[int, float]] | None, device_type: str = "cpu") -> int:
    """The most rows whose pass costs at most ``KNEE_RATIO`` one-row passes (``pass_ms``: the
    machine plan's ``((rows, ms), ...)``; None: a default for the device type)."""
    if not pass_ms:
        return DEFAULT_KNEE.get(device_type, DEFAULT_KNEE["cpu"])
    cost = dict(pass_ms)
    one = cost.get(1, min(cost.values()))
    return max((n for n, ms in cost.items() if ms <= KNEE_RATIO * one), default=1)


def share_rows(wanted: Sequence[int], fixed: Sequence[bool], budget: int, offset: int = 0) -> list[int]:
    """Rows each sequence may verify: ``wanted[i]`` (its proposal, root included) unless the total
    exceeds ``budget``, then a common cap (water-filling: small proposals keep all their rows,
    large ones are cut to the same size), never below 1; rows the cap leaves over go one each to
    the cut sequences from ``offset`` on (rotated turn by turn, so no sequence is always last).
    ``fixed[i]``: keep sequence i's proposal whole (a sampled request: its draws must not depend
    on what else is batched)."""
    if sum(wanted) <= budget:
        return list(wanted)
    free = [w for w, f in zip(wanted, fixed) if not f]
    room = budget - sum(w for w, f in zip(wanted, fixed) if f)
    cap = 1
    while cap < max(free, default=1) and sum(min(w, cap + 1) for w in free) <= room:
        cap += 1
    shares = [w if f else max(1, min(w, cap)) for w, f in zip(wanted, fixed)]
    left = room - sum(s for s, f in zip(shares, fixed) if not f)
    cut = [i for i, (w, f) in enumerate(zip(wanted, fixed)) if not f and w > shares[i]]
    for k in range(min(max(left, 0), len(cut))):
        shares[cut[(offset + k) % len(cut)]] += 1
    return shares
