"""The machine plan: everything an :class:`~medusa.decoding.engine.Engine` takes from what the
machine measured, in one immutable object with the reasons.

``medusa.load`` builds it (:mod:`medusa.autotune.planner`: measured once per machine, cached in
one file) and hands it to the Engine as one argument; an Engine built directly without one runs
:meth:`Plan.default`: nothing measured, the documented defaults below. Each field's value comes
with a :class:`Decision`: what was picked, why, and the seconds its measurement took here (0 when
it was read from the cache or not measured), which ``engine.describe()`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.proposers.lookahead import LookaheadSize
from medusa.errors import MedusaError

# What each field holds when nothing is measured (Plan.default): the target's dtype as loaded,
# torch's own linear kernels, exact attention in half precision only (its own row cap), the
# heads in the target's dtype, EAGLE trees as calibrated for the device type (calibration.json).
DEFAULT_REASON = "default (not measured)"


@dataclass(frozen=True)
class Decision:
    name: str  # "dtype", "kernels", "rows", "draft_dtype", "trees"
    value: object  # what was picked (a str, an int, a size description)
    reason: str  # one line: why
    seconds: float = 0.0  # what measuring it cost in this process (0: cached or not measured)

    def line(self) -> str:
        cost = f" [measured in {self.seconds:.1f} s]" if self.seconds > 0 else ""
        said = self.reason if self.reason.startswith(str(self.value)) else f"{self.value}: {self.reason}"
        return f"{self.name:<11} {said}{cost}"


@dataclass(frozen=True)
class Plan:
    """What the engine runs with. ``dtype``: the target's dtype ("float32", "bfloat16", ...; the
    target must already be in it: ``medusa.load`` converts it); ``kernels``: the linear kernels
    ("default", "onednn", "gemv" or a split such as "gemv>3", medusa/runtime/kernels.py); ``exact``: batch-invariant attention
    (None: on in half precision, medusa/runtime/exact.py); ``max_rows``: rows verified per pass at
    most (None: any, or exact attention's cap), from the invariance probe in half precision;
    ``draft_dtype``: the heads' dtype (None: as they are); ``eagle``/``hybrid``: EAGLE trees sized
    for this machine, or with block heads the block's proposal (mode block's and mode hybrid's;
    medusa/decoding/proposers/block.py) (None: calibrated for the device type); ``lookahead``: mode lookahead's W, N,
    G from the same pass costs (None: by device type); ``pass_ms``: the pass costs the sizing timed;
    ``drawn``: sampled requests' drawn chains per calibrated temperature."""

    dtype: str | None = None
    kernels: str = "default"
    exact: bool | None = None
    max_rows: int | None = None
    draft_dtype: str | None = None
    eagle: DynamicTree | None = None
    hybrid: DynamicTree | None = None
    lookahead: LookaheadSize | None = None
    # this machine's verification pass cost, ((rows, ms), ...), as the tree sizing timed it (heads
    # with static trees: as the kernel pick timed it; None: not measured); a batch's row budget
    # (medusa/serving/budget.py) and a lone sequence's check (medusa/decoding/payoff.py) read it
    pass_ms: tuple[tuple[int, float], ...] | None = None
    # the same pass after longer contexts, ((length, ((rows, ms), ...)), ...) (the sizing's
    # medusa/autotune/sizing.py LENGTHS; ()): a lone sequence's check of what drafting costs reads it
    # (medusa/decoding/payoff.py)
    pass_ms_by_length: tuple = ()
    # EAGLE heads' drawn chains for sampled requests per calibrated temperature, sized with
    # pass_ms ((temperature, mode eagle's size, mode hybrid's with its lookup chain), ...;
    # medusa/autotune/drawn.py); (): the sampled size as before
    drawn: tuple = ()
    decisions: tuple[Decision, ...] = ()

    @classmethod
    def default(cls, model: torch.nn.Module | None = None, reason: str = DEFAULT_REASON) -> Plan:
        """The documented defaults, nothing measured (for ``model``: its dtype as loaded)."""
        dtype = None if model is None else str(model.dtype).removeprefix("torch.")
        decisions = [Decision("kernels", "default", reason), Decision("trees", "calibrated", reason)]
        if dtype is not None:
            decisions.insert(0, Decision("dtype", dtype, f"{reason}: as loaded"))
        return cls(dtype=dtype, decisions=tuple(decisions))

    def decided(self, decision: Decision, **fields) -> Plan:
        """This plan with ``fields`` set and ``decision`` recorded (replacing one of that name)."""
        kept = tuple(d for d in self.decisions if d.name != decision.name)
        return replace(self, **fields, decisions=kept + (decision,))

    def decision(self, name: str) -> Decision | None:
        return next((d for d in self.decisions if d.name == name), None)

    @property
    def seconds(self) -> float:
        """What measuring this plan cost in this process, all decisions together."""
        return sum(d.seconds for d in self.decisions)

    def describe(self) -> list[str]:
        """One line per decision, then the total measurement cost."""
        return [d.line() for d in self.decisions] + [f"measured   {self.seconds:.1f} s in this process"]


def check_plan(model: torch.nn.Module, plan: Plan) -> None:
    """The plan's dtype is the target's: ``medusa.load`` converts the target before the engine."""
    if plan.dtype is not None and plan.dtype != str(model.dtype).removeprefix("torch."):
        raise MedusaError(f"the plan runs the target in {plan.dtype} but it is loaded in {model.dtype}: convert it "
                          f"first (model.to(torch.{plan.dtype})) or build the engine with medusa.load")


def default_mode(heads: torch.nn.Module | None, draft: torch.nn.Module | None = None) -> str:
    """The mode an engine decodes in when none is named (the chat and the bench use it too):
    ``hybrid`` with heads (the heads and prompt lookup in one tree: the fastest mode measured),
    ``draft`` with a draft model, else ``baseline``."""
    if heads is not None:
        return "hybrid"
    return "draft" if draft is not None else "baseline"
