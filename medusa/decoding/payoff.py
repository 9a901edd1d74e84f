"""Whether drafting pays for a sequence decoding alone, measured on its own steps.

A proposer's size comes from the plan: the pass costs timed on this machine and the acceptance
the heads' calibration measured on its own prompts. An answer the heads predict worse than that
(a long document, code or a language they saw little of) can keep fewer tokens a step than its
drafting and extra rows cost, and then plain decoding is faster. So every greedy sequence that
decodes alone carries a :class:`DraftCheck`, which splits each of its drafting steps' time in two:
what the drafting added (the proposer's drafting and update, and the part of the pass its extra
rows cost by the plan's pass curve at the current context length, ``1 - T(1)/T(rows)``) and
what is left, a plain step's time. Drafting pays while the tokens its steps emit, over their
time, beat one token over that plain time (decayed means, about ten steps' worth). Both sides
come from the same steps, so the comparison does not move with the machine's speed from one
moment to the next, which a plain step timed now and a drafting step timed then would; where the
plan has no curve, the extra rows count as free, which favours drafting.

After :data:`WARMUP` drafting steps, where drafting is estimated below :data:`LEAVE` of plain
decoding's speed, the sequence decodes plainly, drafting one step in :data:`EXPLORE` to follow an
answer that starts repeating what the heads or the prompt predict: such a step that keeps a drafted
token resumes drafting, for :data:`GRACE` steps before the check applies again. The plain steps
fade the estimates as drafting steps do, so a step drafted after them counts for the time it
stands for.

Where the proposal has a lean form (mode hybrid: its lookup chain without the heads, whose drafting
and tree can cost more than they add, as after a long document), the check weighs it too: from each
full step, what its chain alone would have emitted (the run of the target's tokens it spelled) and
what its rows would have cost (the plain time grown by the plan's curve); from each lean step, what
it did. Where the lean option's estimate beats the full one's, the sequence drafts lean, in full one
step in :data:`EXPLORE` to keep the full estimate current.

Greedy output never depends on these choices (verification keeps exactly the target's tokens),
so sampled requests, whose random draws follow the proposal, keep theirs. A batch of several
shares its rows by :mod:`medusa.serving.drafting`'s policy instead.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# a medusa.decoding.run.Decoding, and a medusa.decoding.batch.StepReport (both import this module)
Decoding = Any
StepReport = Any

# Chosen by replaying bench runs of every mode that drafted every step (their tokens per step and
# step costs) through the check, on prompts of their own (MT-Bench's first turns and long prompts
# from scripts/long_prompts.py with a seed of their own): the settings that lost least where drafting
# pays, while a drafter that keeps little still turns plain (docs/performance.md#whether-drafting-pays-for-one-sequence)
DECAY = 0.9  # a drafting step's weight fades by this per later step (about ten steps' worth)
WARMUP = 8  # drafting steps before any check (an answer's first steps say little of the rest)
LEAVE = 0.85  # drafting estimated below this share of plain decoding's speed: decode plainly
EXPLORE = 4  # while decoding plainly, one step in this many drafts
GRACE = 8  # after such a step kept a drafted token, drafting steps before the check applies again


class Curve:
    """A pass's cost by rows from the plan's ``((rows, ms), ...)``: interpolated between timed
    sizes, linear past the last; None: flat up to ``knee`` rows, then linear (about a GPU's)."""

    def __init__(self, pass_ms: Sequence[tuple[int, float]] | None, knee: int = 1) -> None:
        points = sorted(dict(pass_ms or ()).items())
        self.rows, self.ms, self.knee = [n for n, _ in points], [ms for _, ms in points], max(1, knee)

    def __call__(self, rows: int) -> float:
        if not self.rows:
            return max(1.0, rows / self.knee)
        i = bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.ms[i]
        if i == 0:
            return self.ms[0]
        j = min(i, len(self.rows) - 1)
        i = j - 1
        slope = (self.ms[j] - self.ms[i]) / (self.rows[j] - self.rows[i])
        return self.ms[i] + slope * (rows - self.rows[i])


class Curves:
    """The plan's pass cost curves: at its sizing context (``pass_ms``) and after longer contexts
    (``by_length``: ``((length, ((rows, ms), ...)), ...)``, medusa/autotune/sizing.py)."""

    def __init__(self, pass_ms: Sequence[tuple[int, float]], by_length: Sequence[tuple[int, Sequence]] = ()) -> None:
        self.base = Curve(pass_ms)
        self.longer = sorted(((int(length), Curve(curve)) for length, curve in by_length), key=lambda item: item[0])

    def at(self, length: int) -> Curve:
        """The curve after ``length`` cached tokens: that of the longest timed length up to it."""
        curve = self.base
        for start, longer in self.longer:
            if length >= start:
                curve = longer
        return curve

    def extra(self, rows: int, length: int) -> float:
        """The share of a ``rows``-row pass after ``length`` cached tokens that its rows beyond
        the first cost (:meth:`at`'s curve)."""
        curve = self.at(length)
        return 0.0 if rows <= 1 else max(0.0, 1.0 - curve(1) / curve(rows))


@dataclass
class Mean:
    """A decayed mean."""

    weight: float = 0.0
    total: float = 0.0

    def add(self, value: float, age: int = 0) -> None:
        """``value``, ``age`` steps after the last one added (each fades it by DECAY)."""
        fade = DECAY ** (age + 1)
        self.weight, self.total = fade * self.weight + 1.0, fade * self.total + value

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight > 0 else 0.0


class DraftCheck:
    """One greedy sequence's check (see the module docstring); ``curves``: the plan's pass costs
    (None: not measured)."""

    def __init__(self, curves: Curves | None = None) -> None:
        self.curves = curves
        self.tokens, self.seconds, self.plain_seconds = Mean(), Mean(), Mean()  # per drafting step
        # the lean option's (a costly drafter left out: mode hybrid's lookup chain alone), from its
        # own steps and from what each full step's chain would have kept alone
        self.lean_tokens, self.lean_seconds = Mean(), Mean()
        self.drafted = 0  # drafting steps observed
        self.plain = False  # decoding plainly (drafting did not pay)
        self.lean = False  # drafting lean (the lean option beat the full one)
        self.since = 0  # plain steps since the last drafting one (they fade its estimates too)
        self.lean_run = 0  # lean steps since the last full one (they fade the full estimates)
        self.grace = 0  # drafting steps left before the check applies again
        self.capped = False  # this step decodes plainly
        self.leaned = False  # this step drafts lean
        self._before: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def ratio(self) -> float | None:
        """The better drafting option's tokens per second over plain decoding's (None: too few
        drafting steps)."""
        if self.drafted < WARMUP or self.seconds.value <= 0:
            return None
        return max(self._rate(self.tokens, self.seconds), self._rate(self.lean_tokens, self.lean_seconds)) \
            * self.plain_seconds.value

    @staticmethod
    def _rate(tokens: Mean, seconds: Mean) -> float:
        return tokens.value / seconds.value if seconds.value > 0 else 0.0

    def cap(self, run: Decoding) -> int | None:
        """This step's rows for ``run`` (1: plain; None: its whole proposal, lean where the lean
        option pays more), its stats noted."""
        capped = self.plain and self.since % EXPLORE != EXPLORE - 1  # one step in EXPLORE drafts
        # one lean step in EXPLORE drafts in full, so the full option's estimate follows the answer
        self.leaned = not capped and not self.plain and self.lean and self.lean_run % EXPLORE != EXPLORE - 1
        self.capped = capped
        run.lean = capped or self.leaned  # a plain or lean step defers the heads' update to the next draft
        stats = run.stats
        self._before = (stats.draft_seconds, stats.verify_seconds, stats.update_seconds)
        return 1 if capped else None

    def observe(self, run: Decoding, rows: int, kept: int, seconds: float | None, length: int) -> None:
        """The step :meth:`cap` began: ``rows`` verified after ``length`` cached tokens, ``kept``
        drafted tokens emitted, in ``seconds`` (None: a step whose time is not a decoding step's,
        counted but not timed)."""
        if self.capped:
            run.stats.plain_steps += 1
            self.since += 1
            return
        if self.leaned:
            run.stats.lean_steps += 1
        if seconds is None:
            return
        age, self.since = self.since, 0
        stats, (draft, verify, update) = run.stats, self._before
        curve = None if self.curves is None else self.curves.at(length)
        extra = 0.0 if self.curves is None else self.curves.extra(rows, length)
        added = (stats.draft_seconds - draft) + (stats.update_seconds - update) + (stats.verify_seconds - verify) * extra
        plain = max(seconds - added, 0.0)
        self.plain_seconds.add(plain, age)
        if self.leaned:
            self.lean_tokens.add(kept + 1, age)
            self.lean_seconds.add(seconds, age)
            self.lean_run += 1
        else:
            alone = getattr(run.proposer, "alone", None)  # (tokens, rows) of its lean option this step
            if alone is not None:
                grown = 1.0 if curve is None else curve(alone[1]) / curve(1)
                self.lean_tokens.add(alone[0], age)
                self.lean_seconds.add(plain * grown, age)
            self.tokens.add(kept + 1, age + self.lean_run)
            self.seconds.add(seconds, age + self.lean_run)
            self.lean_run = 0
        self.drafted += 1
        if self.plain:  # a step drafted to look: one that kept a token drafts on for a while
            self.plain, self.grace = kept == 0, GRACE if kept else 0
        elif self.grace:
            self.grace -= 1
        else:
            ratio = self.ratio()
            self.plain = ratio is not None and ratio < LEAVE
        self.lean = self.drafted >= WARMUP and self._rate(self.lean_tokens, self.lean_seconds) > \
            self._rate(self.tokens, self.seconds)


def caps(running: list[Decoding]) -> list[int | None]:
    """A lone sequence's rows this step by its check (others, and sequences without one: None)."""
    if len(running) != 1 or running[0].check is None:
        return [None] * len(running)
    return [running[0].check.cap(running[0])]


def observe(report: StepReport) -> None:
    """After a step :func:`caps` began: a lone sequence's step to its check (a step that also ran
    a prompt's rows counts, but its time is not a decoding step's)."""
    if report.batch != 1 or len(report.runs) != 1 or report.runs[0].check is None:
        return
    run = report.runs[0]
    seconds = None if report.chunk else report.seconds
    run.check.observe(run, report.drafted[0] + 1, report.kept[0], seconds, run.state.length)
