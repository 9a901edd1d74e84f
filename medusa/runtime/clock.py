"""Opt-in time accounting by kind of work: where a decoding step's time goes.

``with counting() as totals:`` adds to ``totals["linears"]`` the seconds spent in the engine's
packed linear kernels (gemv or oneDNN; torch's own ``F.linear`` is not counted) and to
``totals["attention"]`` those in attention (the one-call kernel, or the per-sequence fallback) and
to ``totals["native"]`` those in whole one-call passes (medusa/runtime/native.py: products,
attention and the small operations together);
everything else in a step (norms, rotary, residuals, sampling, acceptance, bookkeeping) is the
rest (:mod:`medusa.bench.split` reports the three). Outside ``counting`` a kernel call pays one
attribute check.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

_totals: dict[str, float] | None = None


@contextlib.contextmanager
def counting() -> Iterator[dict[str, float]]:
    """Count kernel time into the yielded dict (``linears``, ``attention``, ``native``: seconds) until exit."""
    global _totals
    outer, _totals = _totals, {"linears": 0.0, "attention": 0.0, "native": 0.0}
    try:
        yield _totals
    finally:
        _totals = outer


def charged(kind: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, its seconds added to ``kind`` while :func:`counting`."""
    if _totals is None:
        return fn(*args, **kwargs)
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        if _totals is not None:
            _totals[kind] += time.perf_counter() - t0
