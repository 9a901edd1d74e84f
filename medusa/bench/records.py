"""What a bench run records: one mode's ``Run`` on one prompt, and the ``Bench`` it runs in."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import torch

from medusa.decoding.engine import Engine
from medusa.decoding.sampling import SamplingConfig


@dataclass
class Run:
    """One mode on one prompt."""

    tokens: list[int]
    seconds: float
    steps: int | None = None  # target passes after prefill (None when the mode does not say)
    accepted: list[int] | None = None  # tokens emitted per decode step, when the mode says
    phases: dict[str, float] | None = None  # engine modes: seconds in prefill, draft, verify, update
    first_seconds: float | None = None  # seconds to the first token (the prompt's pass), where the mode says
    plain_steps: int | None = None  # engine modes: steps decoded plainly, drafting not paying (medusa/decoding/payoff.py)
    lean_steps: int | None = None  # engine modes: steps drafted lean, the heads not paying (medusa/decoding/payoff.py)


@dataclass
class Bench:
    """What one bench run decodes with: its settings, and the engines its modes run on, keyed by
    ``(heads kind, compiled, hybrid with lookahead)`` (``None``: the engine ``--heads`` loaded), built on first use
    through ``medusa.load`` on the same target. ``args``: the command line, read only."""

    args: argparse.Namespace
    sampling: SamplingConfig
    max_new_tokens: int
    tree: str | None
    engines: dict[tuple[str | None, bool, bool, str | None], Engine] = field(default_factory=dict)
    plain_targets: dict[str, torch.nn.Module] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def main(self) -> Engine:
        return self.engines[None, False, False, None]

    def shorter(self, max_new_tokens: int) -> Bench:
        return dataclasses.replace(self, max_new_tokens=max_new_tokens)
