"""How much each batched sequence drafts this turn, from what rows and drafting cost here.

A batched turn costs the packed pass over all its rows, T(rows) from the machine plan's timing,
plus each sequence's drafting; it emits one token per sequence plus the drafted tokens the target
keeps. For every greedy sequence the scheduler weighs three options: plain decoding (its root
alone), a **lean** draft (the proposal without a costly drafter's levels: mode hybrid's lookup
chain, where the heads cost more than their rows; :attr:`DecodeState.lean
<medusa.decoding.state.DecodeState.lean>`), or the full proposal; and for each how many rows,
within the turn's row budget. An option is worth its rows where the tokens it is expected to add
exceed what the same milliseconds give plain decoding at this batch size.

The expected tokens come from what this sequence's own drafts kept lately: a drafted chain of
``k`` tokens keeps ``m (a + a^2 + ... + a^k)`` on average, ``m`` the share of turns the option
found anything to draft and ``a`` the chance a drafted token is kept after its parent was
(counted with decay, a few turns' worth, and pulled toward the batch's pooled rates while a
sequence has drafted little). Drafting milliseconds are measured per sequence and option the same
way. Every ``EXPLORE`` turns one sequence (each in turn) drafts as it would alone within its
share (the full option one time, the lean one the next), so the estimates follow an answer that
starts or stops repeating its prompt, at one sequence's drafting cost, not the batch's; an option
that could not pay even if the target kept every token it drafts (its drafting and rows cost
more than its share adds) is not explored: the whole batch waits for that sequence's drafting. Greedy
output never depends on this choice (verification keeps exactly the target's tokens); sampled
requests keep their whole proposal (docs/exactness.md#batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from medusa.decoding.payoff import Curve

EXPLORE = 8  # every 8th turn one sequence drafts as alone, full and lean in turn: the estimates stay fresh
DECAY = 0.85  # a sequence's counts fade by this per observation (about 7 turns' worth)
POOL_DECAY = 0.98  # the batch's pooled counts (priors for sequences that have drafted little)
PRIOR = 1.0  # weight of the pooled rates in a sequence's estimate, in observations
OPTIONS = ("lean", "full")


@dataclass
class Counts:
    """Decayed counts of one option's drafts: tokens kept, drafts cut short, turns, turns that
    drafted something, drafting milliseconds."""

    kept: float = 0.0
    cut: float = 0.0
    turns: float = 0.0
    found: float = 0.0
    ms: float = 0.0

    def add(self, drafted: int, kept: int, ms: float, decay: float) -> None:
        self.kept, self.cut = decay * self.kept + kept, decay * self.cut + (kept < drafted)
        self.turns, self.found = decay * self.turns + 1, decay * self.found + (drafted > 0)
        self.ms = decay * self.ms + ms


@dataclass
class Estimate:
    """Expected drafted tokens kept with ``rows`` rows, and the drafting's milliseconds."""

    keep: float  # a: a drafted token kept after its parent was
    found: float  # m: the share of turns with a draft
    ms: float

    def gain(self, rows: int) -> float:
        a, k = self.keep, rows - 1
        if k <= 0 or a <= 0.0:
            return 0.0
        return self.found * (a * k if a >= 1.0 else a * (1.0 - a**k) / (1.0 - a))


@dataclass
class Choice:
    rows: int  # rows this turn, root included (1: plain decoding)
    lean: bool  # drafted without the costly drafter


@dataclass
class DraftPolicy:
    """The per-turn choice (see the module docstring). ``pass_ms``: the plan's ``((rows, ms), ...)``
    (None: a flat cost up to ``knee`` rows, then linear: about a GPU's curve)."""

    pass_ms: Sequence[tuple[int, float]] | None
    knee: int
    seqs: dict[object, dict[str, Counts]] = field(default_factory=dict)
    pool: dict[str, Counts] = field(default_factory=lambda: {o: Counts() for o in OPTIONS})
    # a turn's time beyond its pass and drafting, fitted as ``base + per_draft * (sequences that
    # drafted)``: decayed sums of (1, x, y, x^2, xy) over turns (a tree's verification and
    # acceptance cost more than a root's)
    fit: list[float] = field(default_factory=lambda: [0.0] * 5)
    turns: int = 0

    def __post_init__(self) -> None:
        self._curve = Curve(self.pass_ms, self.knee)

    def cost(self, rows: int) -> float:
        """The pass over ``rows`` rows, ms (interpolated; past the last timed size, linear)."""
        return self._curve(rows)

    def estimate(self, seq: object, option: str) -> Estimate:
        own, pool = self.seqs.get(seq, {}).get(option, Counts()), self.pool[option]
        pooled_keep = pool.kept / (pool.kept + pool.cut) if pool.kept + pool.cut > 0 else 0.5
        pooled_found = pool.found / pool.turns if pool.turns > 0 else 1.0
        pooled_ms = pool.ms / pool.turns if pool.turns > 0 else 0.0
        keep = (own.kept + PRIOR * pooled_keep) / (own.kept + own.cut + PRIOR)
        found = (own.found + PRIOR * pooled_found) / (own.turns + PRIOR)
        ms = (own.ms + PRIOR * pooled_ms) / (own.turns + PRIOR)
        return Estimate(keep, found, ms)

    @property
    def exploring(self) -> bool:
        """One sequence drafts as alone this turn (every ``EXPLORE`` turns)."""
        return self.turns % EXPLORE == 0

    def choose(self, seqs: Sequence[object], shares: Sequence[int], others: int = 0,
               again: bool = False) -> list[Choice]:
        """Each greedy sequence's option and rows, at most ``shares[i]`` (its part of the turn's
        budget); ``others``: rows of sequences that keep their whole proposal (sampled ones);
        ``again``: the same turn, with the shares that plain sequences left."""
        if not again:
            self.turns += 1
        if not seqs:
            return []
        explored = -1
        if self.exploring:  # one sequence drafts as alone, within its share: the estimates stay fresh
            explored = (self.turns // EXPLORE) % len(seqs)
        plain = len(seqs) + others
        overhead, per_draft = self.overhead()
        base = self.cost(plain) + overhead
        rate = len(seqs) / base  # tokens per ms of plain decoding at this batch: what drafting must beat
        top = max(plain, plain + sum(s - 1 for s in shares))
        per_row = (self.cost(top) - self.cost(plain)) / max(1, top - plain)
        out = []
        for i, (seq, share) in enumerate(zip(seqs, shares)):
            if i == explored:
                lean = (self.turns // EXPLORE // len(seqs)) % 2 == 1  # both options in turn
                ms = self.estimate(seq, "lean" if lean else "full").ms
                if share - 1 > rate * (ms + per_draft + per_row * (share - 1)):  # could pay if all were kept
                    out.append(Choice(share, lean))
                    continue
            best, value = Choice(1, False), 0.0
            for option in OPTIONS:
                est = self.estimate(seq, option)
                for rows in range(2, share + 1):
                    v = est.gain(rows) - rate * (est.ms + est.found * (per_draft + per_row * (rows - 1)))
                    if v > value:
                        best, value = Choice(rows, option == "lean"), v
            out.append(best)
        return out

    def observe(self, seq: object, choice: Choice, drafted: int, kept: int, ms: float) -> None:
        """What a sequence's turn drafted (tokens), kept, and its drafting took (ms)."""
        if choice.rows <= 1:
            return
        option = "lean" if choice.lean else "full"
        self.seqs.setdefault(seq, {o: Counts() for o in OPTIONS})[option].add(drafted, kept, ms, DECAY)
        self.pool[option].add(drafted, kept, ms, POOL_DECAY)

    def turn_took(self, seconds: float, rows: int, drafting_ms: float, drafted: int) -> None:
        """A turn's wall-clock time, its rows, its drafting and how many sequences drafted: the
        rest is overhead."""
        y = max(0.0, 1000.0 * seconds - self.cost(rows) - drafting_ms)
        for i, v in enumerate((1.0, drafted, y, drafted * drafted, drafted * y)):
            self.fit[i] = POOL_DECAY * self.fit[i] + v

    def overhead(self) -> tuple[float, float]:
        """A turn's overhead in ms: ``(base, per drafting sequence)`` (least squares, the slope
        at least 0; 0 until measured)."""
        n, sx, sy, sxx, sxy = self.fit
        if n <= 0:
            return 0.0, 0.0
        var = sxx / n - (sx / n) ** 2
        slope = max(0.0, (sxy / n - sx * sy / n / n) / var) if var > 1e-6 else 0.0
        return max(0.0, sy / n - slope * sx / n), slope

    def forget(self, seq: object) -> None:
        self.seqs.pop(seq, None)
