"""Probes of what this device's kernels do, each a plain function the planner
(medusa/autotune/planner.py) calls and caches:

- :func:`linear_invariant_rows` / :func:`invariant_rows`: the largest pass whose rows are
  bitwise their one-row results (in half precision the engine verifies at most that many rows
  per pass; kernels may change blocking with the row count, at a count that differs between
  CPUs, from 2 rows on some: docs/exactness.md#exactness-in-bfloat16).
- :func:`linear_seconds`: the model's linear-layer shapes timed with synthetic inputs in a
  dtype (the dtype rule's speed gap, medusa/autotune/dtype.py: no copy of the model).
- :func:`measure_kernels` / :func:`decide_kernels`: torch's default linear kernels (MKL for
  float32; oneDNN with the weight in its plain layout for bfloat16) against packed oneDNN
  weights (medusa/runtime/kernels.py) and, in float32, this package's gemv kernels
  (medusa/runtime/gemv.py), on the model's own pass; in half precision packed kernels must
  also pass the invariance probe. In float32 the pick may split by pass size ("gemv>3": torch's
  kernel for the passes of 1-3 rows where it is the faster one, gemv above).
- :func:`measure_draft_scoring` / :func:`decide_draft_dtype`: the heads' dtype. Drafting only
  proposes and the target verifies every token in its own dtype, so heads may draft in
  bfloat16 beside a float32 target without touching an output token; their main cost is scoring
  a few features over the draft vocabulary (a memory-bound ``[S, H]`` matmul).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext

import torch
from transformers import PreTrainedModel

from medusa.autotune.timing import measure_costs
from medusa.runtime import gemv
from medusa.runtime.exact import is_exact, set_exact
from medusa.runtime.kernels import (
    PackedLinears,
    linear_layers,
    onednn_available,
    pack,
    packed_product,
    sibling_groups,
)

SIZES = (1, 16)  # a plain decoding step and a typical tree
# float32 also times the sizes between, where a split's boundary may fall: an empty draft (1),
# hybrid's lookup chain (2-3), small trees (4, 8)
SPLIT_SIZES = (1, 2, 3, 4, 8, 16)
MARGIN = 0.9  # packed kernels (bf16 heads) must cost under 90% of the default's: timings on a shared machine are noisy
PROBE_ROWS = 64  # the largest pass the engine verifies (a calibrated tree or a drafted chain)
PROBE_PREFIX = 170  # rows see 171-234 keys: both sides of a head boundary of exact attention (medusa/runtime/exact.py)
MIN_ROWS = 8  # bfloat16 only if passes this large are exact: smaller trees would not pay
DRAFT_ROWS = 4  # features a drafting step scores at once (a dynamic tree level, a few Medusa heads)


def _order_sensitive(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, k]`` float32 inputs whose dot product with a row of ones depends on the order
    of summation: small terms (+-1 to +-32) between pairs of +-2^30 at random places, so a
    running sum that holds a big term absorbs the small ones and another order (other lanes,
    blocking or unrolling) absorbs others. On random activations a kernel's changed order shows
    only when a bf16 rounding happens to flip, so a kernel these inputs show changing from 2 rows
    may differ on the model's own activations only at some prompts
    (docs/exactness.md#exactness-in-bfloat16)."""
    x = torch.randint(0, 6, (rows, k), generator=gen).float().exp2() * (torch.randint(0, 2, (rows, k), generator=gen) * 2 - 1)
    big = max(2, k // 16) // 2 * 2
    where = torch.rand(rows, k, generator=gen).argsort(-1)[:, :big]
    return x.scatter(1, where, (2.0 ** 30 * torch.tensor([1.0, -1.0])).repeat(big // 2).expand(rows, big).contiguous())


def _linear_of_ones(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device, kernels: str):
    """``x -> x @ ones.T`` by torch's ``F.linear`` or (``kernels="onednn"``) a packed oneDNN weight."""
    weight = torch.ones(out_features, in_features, dtype=dtype, device=device)
    if kernels == "onednn":
        packed = pack(weight)
        return lambda x: packed_product(x, packed, weight, None)
    return lambda x: torch.nn.functional.linear(x, weight)


@torch.inference_mode()
def linear_invariant_rows(model: PreTrainedModel, limit: int = PROBE_ROWS, kernels: str = "default",
                          dtype: torch.dtype | None = None) -> int:
    """The largest ``r <= limit`` such that every linear layer shape of ``model``, run by these
    ``kernels`` in the model's dtype (or ``dtype``: weights of ones need no copy of it), gives each row of an ``n``-row product (``n`` in ``2..r``)
    bitwise its one-row result, on :func:`_order_sensitive` inputs (weights of ones), on each
    layer's own device (the inputs are drawn on the CPU and moved there)."""
    gen = torch.Generator().manual_seed(0)
    layers = linear_layers([model])
    shapes = {(tuple(layer.weight.shape), dtype or layer.weight.dtype, layer.weight.device) for layer in layers}
    if kernels == "onednn":  # and the stacked products of sibling layers (kernels._Siblings)
        shapes |= {((sum(layer.out_features for layer in group), group[0].in_features), dtype or group[0].weight.dtype,
                    group[0].weight.device) for group in sibling_groups([model], layers)}
    rows = limit
    for (out_features, in_features), dtype, device in sorted(shapes, key=str):
        linear = _linear_of_ones(out_features, in_features, dtype, device, kernels)
        x = _order_sensitive(rows, in_features, gen).to(device=device, dtype=dtype)
        ones = [linear(x[i:i + 1])[0] for i in range(rows)]
        for n in range(2, rows + 1):
            many = linear(x[:n])
            if any(not torch.equal(ones[i], many[i]) for i in range(n)):
                rows = n - 1
                break
        if rows == 1:
            break
    return rows


@torch.inference_mode()
def invariant_rows(model: PreTrainedModel, limit: int = PROBE_ROWS, prefix: int = PROBE_PREFIX,
                   kernels: str = "default") -> int:
    """The largest ``r <= limit`` such that a pass of every size ``2..r`` gives each of its rows
    bitwise the logits of that row's one-token pass (1: none does). A device's matmul kernels
    may change blocking with the row count (docs/exactness.md#exactness-in-bfloat16), so the
    engine verifies at most this many rows per pass. Two probes, the smaller
    wins: the model itself (one-token passes run once; the many-token passes stop at the first
    size that differs), whose rows differ only where a rounding happens to flip on this prompt,
    and its linear layers' shapes on inputs that show any change of summation order
    (:func:`linear_invariant_rows`, with the ``kernels`` the model runs: "onednn" inside
    :class:`~medusa.runtime.kernels.PackedLinears`)."""
    from medusa.runtime import hf as kv

    limit = linear_invariant_rows(model, limit, kernels)
    if limit == 1:
        return 1

    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_output_embeddings().weight.device
    ids = (torch.arange(prefix + limit, device=device) * 7919 + 13) % max(vocab - 1, 1) + 1

    def prefilled():
        cache = kv.new_cache()
        kv.forward(model, ids[None, :prefix], torch.arange(prefix, device=device)[None], cache, None)
        return cache

    cache, ones = prefilled(), []
    for i in range(limit):
        one, _ = kv.forward(model, ids[None, prefix + i:prefix + i + 1], torch.tensor([[prefix + i]], device=device),
                            cache, None)
        ones.append(one[0])
    for n in range(2, limit + 1):
        many, _ = kv.forward(model, ids[None, prefix:prefix + n], torch.arange(prefix, prefix + n, device=device)[None],
                             prefilled(), None)
        if any(not torch.equal(ones[i], many[i]) for i in range(n)):
            return n - 1
    return limit


def bf16_supported(device: torch.device) -> bool:
    """Whether torch runs bfloat16 on ``device`` at all (every CPU does, some by emulation)."""
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def linear_seconds(model: PreTrainedModel, dtypes: tuple[torch.dtype, ...], rows: int = 16, reps: int = 15,
                   ) -> dict[str, float]:
    """Seconds of one pass through every linear layer of ``model`` (``rows`` input rows: a tree
    speculation verifies), per dtype, on synthetic weights and inputs of the layers' shapes (no
    copy of the model: one weight per distinct shape, counted as often as the shape occurs).
    Dtypes and shapes alternate each round, and each shape keeps its *fastest* round: other
    processes only ever add time, so the minimum is what the kernels cost."""
    device = model.get_output_embeddings().weight.device
    counts: dict[tuple[int, int], int] = {}
    for layer in linear_layers([model]):
        counts[tuple(layer.weight.shape)] = counts.get(tuple(layer.weight.shape), 0) + 1
    gen = torch.Generator().manual_seed(0)
    operands = {(shape, dtype): (torch.randn(rows, shape[1], generator=gen).to(device, dtype),
                                 torch.randn(*shape, generator=gen).to(device, dtype))
                for shape in counts for dtype in dtypes}
    best = dict.fromkeys(operands, float("inf"))
    for i in range(reps + 1):
        for (shape, dtype), (x, w) in operands.items():
            _sync(device)
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            _sync(device)
            if i:  # the first round warms the kernels up
                best[shape, dtype] = min(best[shape, dtype], time.perf_counter() - t0)
    return {str(d).removeprefix("torch."): sum(best[s, d] * n for s, n in counts.items()) for d in dtypes}


@contextmanager
def _exact(model: PreTrainedModel):
    """``model`` with exact attention on (how a half-precision engine runs it), then as it was."""
    was = is_exact(model)
    set_exact(model, True)
    try:
        yield model
    finally:
        set_exact(model, was)


LABELS = {"onednn": "oneDNN", "gemv": "gemv (this package's float32)"}


def decide_kernels(cost_ms: dict[str, dict[int, float]], invariant_rows: int | None = None,
                   half: bool = False) -> tuple[str, str]:
    """``(kernels, reason)``: the packed kernels (oneDNN's, or for float32 the gemv kernels of
    medusa/runtime/gemv.py) whose passes of the timed sizes cost least together, if that is
    under ``MARGIN`` of the default kernels' (torch's own: MKL for float32 on a CPU) and, for a
    ``half``-precision model, passes of at least ``MIN_ROWS`` rows stay exact with them
    (``invariant_rows``); else the default. In float32 a candidate may also split by size
    (``"gemv>3"``: the default kernels for passes of 1-3 rows, gemv above) where the default is
    the cheaper one for every size up to the split."""
    packed = [k for k in ("gemv", "onednn") if k in cost_ms]
    if not packed:
        return "default", "default linear kernels: this device has no packed oneDNN linears"
    detail = " vs ".join(f"{k} " + " ".join(f"T({n})={ms:.1f}" for n, ms in sorted(c.items())) + " ms"
                         for k, c in cost_ms.items())
    total = {k: sum(cost_ms[k].values()) for k in packed}
    if not half:
        total.update(_splits(cost_ms, packed))
    best = min(total, key=total.__getitem__)
    default = sum(cost_ms["default"].values())
    if total[best] >= MARGIN * default:
        return "default", f"default linear kernels: packed ones ({', '.join(LABELS[k] for k in packed)}) are not " \
                          f"faster here by measurement, {detail}"
    if half and (invariant_rows is None or invariant_rows < MIN_ROWS):
        return "default", (f"default linear kernels: {LABELS[best]}'s are faster here ({detail}) but not exact: "
                           f"a pass of {(invariant_rows or 1) + 1} rows differs from its one-token passes")
    exact = f", exact up to {invariant_rows} rows" if half else ""
    base, _, rows = best.partition(">")
    label = f"{LABELS[base]} above {rows} rows, the default's up to {rows}" if rows else LABELS[best]
    return best, f"{label} linear kernels: faster here by measurement{exact}, {detail}"


def _splits(cost_ms: dict[str, dict[int, float]], packed: list[str]) -> dict[str, float]:
    """``{"gemv>3": total ms, ...}``: each packed kernel split after each timed size up to which
    the default kernels are the cheaper at every size (the default's costs there, the packed
    kernel's above)."""
    sizes = sorted(cost_ms["default"])
    out = {}
    for k in packed:
        for i, r in enumerate(sizes[:-1]):
            if cost_ms["default"][r] >= cost_ms[k][r]:  # the smaller sizes all passed this test
                break
            out[f"{k}>{r}"] = sum(cost_ms["default"][n] for n in sizes[:i + 1]) + sum(cost_ms[k][n] for n in sizes[i + 1:])
    return out


def measure_kernels(model: PreTrainedModel, prefix: int = 128, reps: int = 7,
                    memory: int | None = None) -> dict[str, dict[int, float]]:
    """Pass cost by new-token count (``SIZES``; ``SPLIT_SIZES`` in float32, where a pick may
    split by size) with the default, with packed oneDNN linears (for a
    half-precision model with exact attention, as its engine runs it) and, for a float32 model
    where they build, the gemv kernels; timed round-robin. Each packed variant holds a copy of
    the linear weights: where two copies would take more than half of ``memory`` (bytes; None:
    what the system has available), each is timed against the default alone, one after the
    other, its copy freed before the next is made."""
    device = model.get_output_embeddings().weight.device
    packed = [kind for kind, ok in (("onednn", onednn_available(device, model.dtype)),
                                    ("gemv", gemv.available(device, model.dtype))) if ok]
    default = {"default": (model, nullcontext())}
    sizes = list(SPLIT_SIZES if model.dtype == torch.float32 else SIZES)
    with _exact(model) if model.dtype != torch.float32 else nullcontext():
        if len(packed) < 2 or 2 * linear_bytes(model) <= (available_memory() if memory is None else memory) / 2:
            variants = {**default, **{kind: (model, PackedLinears(model, kernels=kind)) for kind in packed}}
            return measure_costs(variants, sizes, prefix=prefix, reps=reps)
        costs: dict[str, dict[int, float]] = {}
        for kind in packed:
            pair = measure_costs({**default, kind: (model, PackedLinears(model, kernels=kind))}, sizes,
                                 prefix=prefix, reps=reps)  # the pair's packed copy is garbage once timed
            costs.setdefault("default", pair["default"])
            costs[kind] = pair[kind]
        return costs


def linear_bytes(model: PreTrainedModel) -> int:
    """Bytes of the weights of the model's linear layers (what a packed variant copies)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))


def available_memory() -> int:
    """Bytes of memory the system can give now (Linux's MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_draft_scoring(hidden: int, rows: int, device: torch.device, reps: int = 20) -> dict[str, float]:
    """Median ms to score ``DRAFT_ROWS`` features against ``rows`` vocabulary rows of width
    ``hidden`` (the heads' dominant drafting cost), in float32 and in bfloat16 (where supported).
    Random weights: only the shapes and the kernels matter."""

    costs = {}
    dtypes = (torch.float32, torch.bfloat16) if bf16_supported(device) else (torch.float32,)
    for dtype in dtypes:
        gen = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
        x = torch.randn(DRAFT_ROWS, hidden, generator=gen).to(device=device, dtype=dtype)
        times = []
        with torch.inference_mode():
            for i in range(reps + 3):
                _sync(device)
                t0 = time.perf_counter()
                _ = x @ w.T
                _sync(device)
                if i >= 3:  # warm-up calls excluded
                    times.append((time.perf_counter() - t0) * 1e3)
        costs[str(dtype).removeprefix("torch.")] = sorted(times)[len(times) // 2]
    return costs


def decide_draft_dtype(cost_ms: dict[str, float]) -> tuple[str, str]:
    """``(dtype, reason)``: bfloat16 heads only if their scoring costs under ``MARGIN`` of float32's."""
    if "bfloat16" not in cost_ms:
        return "float32", "float32 heads: this device has no bfloat16 support"
    detail = f"scoring {DRAFT_ROWS} rows: float32 {cost_ms['float32']:.2f} vs bfloat16 {cost_ms['bfloat16']:.2f} ms"
    if cost_ms["bfloat16"] >= MARGIN * cost_ms["float32"]:
        return "float32", f"float32 heads: bfloat16 is not faster here by measurement, {detail}"
    return "bfloat16", f"bfloat16 heads (drafts only; the target verifies in float32): faster here, {detail}"
