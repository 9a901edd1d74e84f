"""The target's dtype: a pick that changes the numbers the target computes, so it must come out
the same every time on one machine type. It is decided from what the hardware *is* and *does*,
never from a close timing:

1. **Capability.** bfloat16 only where the device multiplies it natively: a CPU with AMX
   (``amx_bf16``), a GPU that supports bfloat16 (``torch.cuda.is_bf16_supported``). An AVX2-only
   CPU emulates bf16 matmuls (slower than float32); an AVX-512 BF16 CPU without AMX runs them,
   but on those measured its bf16 rows changed with the row count
   (docs/exactness.md#exactness-in-bfloat16), so both keep float32 without measuring anything.
2. **Exactness.** The model's linear-layer shapes in bfloat16 (weights of ones, inputs that show
   any change of summation order: :func:`medusa.autotune.device.linear_invariant_rows`) must give
   every row of passes of up to ``MIN_ROWS`` rows bitwise its one-row result. Deterministic.
3. **A large speed gap.** The linear layers' shapes with synthetic inputs, at one row (plain
   decoding, a step with nothing drafted) and at 16 rows (a tree), timed in both dtypes
   alternately, each shape's fastest round kept (:func:`medusa.autotune.device.linear_seconds`):
   bfloat16 only when it costs at most ``GAP`` (60%) of float32's at both sizes. Noise from other
   processes only adds time and the minimum discards it; what remains moves a ratio by a few
   percent. Both sizes, because the one-row ratio is the one far from 0.6: even with AMX,
   bfloat16 need not be cheaper than float32 at one row, while the 16-row ratio can sit at the
   gap, so the 16-row ratio alone can straddle it from one run to the next and change outputs
   between runs for trees only AMX makes cheaper (docs/machine-plan.md#the-dtype-rule); emulated
   bf16 is above 1 at both.

All three hold: bfloat16, and after converting, the model itself is probed for its exact passes
(the engine verifies at most that many rows). Any fails: float32. Only float32-loaded targets are
picked for; a target loaded in another dtype (or one asked for) keeps it.
"""

from __future__ import annotations

import torch

GAP = 0.6  # bfloat16's linear layers must cost at most this share of float32's
MIN_ROWS = 8  # bfloat16 only if passes this large are exact: smaller trees would not pay
RATIO_ROWS = (1, 16)  # the pass sizes whose linear-layer cost bfloat16 must cut (the dearer ratio counts)


def native_bf16(device: torch.device, flags: set[str]) -> tuple[bool, str]:
    """Whether ``device`` multiplies bfloat16 natively, and what says so (``flags``: the CPU's)."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'lacks'} bfloat16"
    if device.type != "cpu":
        return False, f"bfloat16 is not measured on {device.type}"
    if "amx_bf16" in flags:
        return True, "this CPU has AMX (amx_bf16)"
    has = "AVX-512 BF16" if "avx512_bf16" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return False, f"this CPU has {has} but no AMX: its bfloat16 matmuls are emulated or not row-invariant"


def dtype_rule(native: bool, why: str, invariant_rows: int | None = None, ratio: float | None = None,
               ) -> tuple[str, str]:
    """``(dtype, reason)`` by the rule of the module docstring. ``invariant_rows``: the linear
    probe's exact rows in bfloat16 (None: not probed); ``ratio``: bfloat16's linear cost over
    float32's, the dearer of ``RATIO_ROWS`` (None: not timed). A step that was not taken counts as failed."""
    if not native:
        return "float32", f"float32: {why}"
    if invariant_rows is None or invariant_rows < MIN_ROWS:
        return "float32", (f"float32: {why}, but bfloat16 passes of {(invariant_rows or 1) + 1} rows give some row "
                           "other values than one-row passes, so speculation could change outputs")
    if ratio is None or ratio > GAP:
        shown = "not timed" if ratio is None else f"{ratio:.2f}x float32's"
        return "float32", f"float32: {why} and exact bfloat16 up to {invariant_rows} rows, but its linear layers cost " \
                          f"{shown} at one row or 16 (bfloat16 needs at most {GAP}x at both)"
    return "bfloat16", (f"bfloat16: {why}, exact up to {invariant_rows} rows, linear layers at {ratio:.2f}x "
                        f"float32's cost (at most {GAP}x needed)")
