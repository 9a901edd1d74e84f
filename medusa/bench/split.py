"""Where a decoding step's time goes, at one sequence and at several: the linear layers (the
engine's packed kernels), attention, whole one-call passes (medusa/runtime/native.py: the
decoder's products, attention and small operations in one C call), and everything else (the
module path's norms, rotary, residuals; sampling, acceptance, bookkeeping). Plain decoding, so every
sequence has one row and the split is the step's own, not the drafter's."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from medusa.decoding.batch import Batch
from medusa.decoding.request import make_request
from medusa.runtime import clock


@dataclass
class Split:
    """One batch size's mean over ``steps`` steps, in milliseconds per step."""

    batch: int
    steps: int
    step_ms: float
    linears_ms: float
    attention_ms: float
    native_ms: float = 0.0

    @property
    def other_ms(self) -> float:
        return max(0.0, self.step_ms - self.linears_ms - self.attention_ms - self.native_ms)

    def as_dict(self) -> dict:
        return {**asdict(self), "other_ms": self.other_ms}


def step_split(engine, prompts: list[list[int]], batches: tuple[int, ...] = (1, 8), steps: int = 20,
               warmup: int = 3) -> list[Split]:
    """Run ``batch`` sequences of plain decoding together (prompts reused round-robin) for
    ``warmup`` + ``steps`` steps each, timing the last ``steps`` (:mod:`medusa.runtime.clock`)."""
    if not prompts:
        raise ValueError("step_split needs at least one prompt")
    out = []
    for size in batches:
        batch = Batch(engine.passes, engine.max_rows)
        for i in range(size):
            request = make_request(prompts[i % len(prompts)], max_new_tokens=warmup + steps + 1, mode="baseline",
                                   ignore_eos=True)
            batch.add(engine.decoding(request))
        with engine.owned():
            while batch.prefilling:
                batch.prefill()
            for _ in range(warmup):
                batch.step()
            with clock.counting() as totals:
                t0 = time.perf_counter()
                for _ in range(steps):
                    batch.step()
                seconds = time.perf_counter() - t0
        out.append(Split(size, steps, 1e3 * seconds / steps, 1e3 * totals["linears"] / steps,
                         1e3 * totals["attention"] / steps, 1e3 * totals["native"] / steps))
    return out


def split_lines(splits: list[Split]) -> list[str]:
    """The split as lines of text: per batch size the step and its parts, and each size against one."""
    lines = ["step split (plain decoding, ms per step): sequences | step | linears | attention | one-call pass | other"]
    for s in splits:
        lines.append(f"  {s.batch:>2} | {s.step_ms:6.1f} | {s.linears_ms:6.1f} | {s.attention_ms:5.1f} | "
                     f"{s.native_ms:6.1f} | {s.other_ms:5.1f}")
    if len(splits) > 1 and splits[0].batch == 1:
        lines += [f"  {s.batch} sequences' step = {s.step_ms / splits[0].step_ms:.2f}x one sequence's"
                  for s in splits[1:]]
    return lines
