"""The dtype per device, chosen by measurement (never by CPU or GPU name) and cached.

bfloat16 halves the bytes a pass reads, but only some devices compute it fast: GPUs and CPUs
with AMX run bf16 matmuls natively; an AVX2-only CPU emulates them and runs float32 faster.
So the pick times the target's pass over 1 and 16 new tokens (``measure_cost``, the numbers
tree calibration uses) in float32 and in bfloat16 *with exact attention* (the bf16 mode that
keeps the promise, medusa/runtime/exact.py), and keeps bfloat16 only when its 16-token
pass (what speculation verifies) is clearly faster **and** exact here: exact attention makes
attention batch-invariant, but whether the linear layers are depends on the device's kernels
(bit-identical up to 32 rows on one AMX Xeon, not above; on an AMD EPYC Zen 5 a one-row bf16
product differed from the same row in 2+ rows), so :func:`invariant_rows` finds the largest exact pass on the model itself and on
its linear layers' shapes with inputs that expose any change of summation order (a changed
order shows on real activations only where a rounding happens to flip), and the engine
verifies at most that many rows per pass.
The result is cached in ``cache_root()/dtype.json`` under a key of the device (CPU flags or
GPU name), the torch version and the model's shape, so it is measured once.

The linear kernels of a model on a CPU are picked the same way (:func:`pick_kernels`, cached
in ``kernels.json``): torch's default (MKL for float32; oneDNN with the weight in its plain
layout for bfloat16) or packed oneDNN weights (medusa/runtime/kernels.py), whichever times
faster. A half-precision model keeps packed kernels only if they are exact too: the invariance
probe runs again with them (:func:`exact_rows`), and the engine's pass cap comes from that run.

The heads' dtype is picked apart from the target's (:func:`pick_draft_dtype`, cached in
``draft_dtype.json``): drafting only proposes and the target verifies every token in its own
dtype, so heads may draft in bfloat16 beside a float32 target without touching a single output
token. Their main cost is scoring a few features over the draft vocabulary (a memory-bound
``[S, H]`` matmul); bfloat16 halves the bytes, and is kept where it times faster.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from medusa.autotune.timing import measure_cost, measure_costs
from medusa.errors import MedusaError
from medusa.runtime.exact import is_exact, set_exact
from medusa.runtime.files import atomic_file, drop_cache_entry, read_json
from medusa.runtime.kernels import (
    PackedLinears,
    kernels_key,
    linear_layers,
    onednn_available,
    pack,
    packed_product,
    sibling_groups,
)

SIZES = (1, 16)  # a plain decoding step and a typical tree
MARGIN = 0.9  # bf16's 16-row pass must cost under 90% of fp32's: timings on a shared machine are noisy
PROBE_ROWS = 64  # the largest pass the engine verifies (a calibrated tree or a drafted chain)
PROBE_PREFIX = 170  # rows see 171-234 keys: both sides of a head boundary of exact attention (medusa/runtime/exact.py)
KERNEL_KEY_VERSION = "k3"  # k2: packed weights in the blocked layout (kernels.PACKING_VERSION 2); k3: stacked siblings (3)
DRAFT_KEY_VERSION = "d1"
MIN_ROWS = 8  # bfloat16 only if passes this large are exact: smaller trees would not pay
DRAFT_ROWS = 4  # features a drafting step scores at once (a dynamic tree level, a few Medusa heads)
BUSY_SHARE = 0.25  # other processes used this much of the CPUs while a pick was timed: time it again
KEY_VERSION = "v6"  # v3: the pick records the largest exact pass; v4: decided on the 16-row pass; v5: linear probe;
# v6: exact attention through the CPU flash kernel
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" or "bfloat16"
    reason: str  # one line for the chat banner and the bench
    cost_ms: dict[str, dict[int, float]]  # dtype -> {new tokens: ms per pass}
    invariant_rows: int | None = None  # bfloat16 passes of up to this many rows are exact (None: not probed)


def device_key(device: torch.device) -> str:
    """What decides the fast dtype: the GPU's name and capability, or the CPU's vector and
    matrix extensions; plus the torch version (kernels change between releases)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    else:
        flags: set[str] = set()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.exists():
            line = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
            flags = set(line.split(":", 1)[-1].split())
        found = [f for f in _CPU_FLAGS if f in flags] or [platform.machine()]
        name = f"cpu {torch.backends.cpu.get_cpu_capability()} {'+'.join(found)}"
    return f"{name} | torch {torch.__version__}"


def model_key(model: PreTrainedModel) -> str:
    config = model.config.get_text_config()
    return f"{config.model_type} h{config.hidden_size} l{config.num_hidden_layers} v{config.vocab_size}"


def decide(cost_ms: dict[str, dict[int, float]], invariant_rows: int | None = PROBE_ROWS) -> tuple[str, str]:
    """``(dtype, reason)`` from measured pass costs: bfloat16 only if its 16-row pass (a
    calibrated tree with a lookup chain: what the engine's default mode verifies each step)
    costs under ``MARGIN`` of float32's, and passes of at least
    ``MIN_ROWS`` rows give every row bitwise its one-token logits (``invariant_rows``, from
    :func:`invariant_rows`; None: not probed, as when bfloat16 is not faster anyway). The
    engine then verifies at most ``invariant_rows`` rows per pass."""
    if "bfloat16" not in cost_ms:
        return "float32", "float32: this device has no bfloat16 support"
    # not T(1): speculation runs trees; on one AMX Xeon bfloat16 (exact) cost 1.26x float32 for
    # one token but 0.79x for 16, and its eagle-hybrid ran 1.23x its float32 self
    # (docs/benchmarks/amx-xeon-stock-kernels.md)
    fp32, bf16 = cost_ms["float32"][16], cost_ms["bfloat16"][16]
    detail = " vs ".join(f"{d} T(1)={c[1]:.1f} T(16)={c[16]:.1f} ms" for d, c in cost_ms.items())
    if bf16 >= MARGIN * fp32:
        return "float32", f"float32: bfloat16 is not faster here by measurement, {detail}"
    if invariant_rows is None or invariant_rows < MIN_ROWS:
        return "float32", (f"float32: bfloat16 is faster here ({detail}) but not exact: a pass of "
                           f"{(invariant_rows or 1) + 1} rows gives some row other logits than its one-token pass "
                           "(this device's kernels depend on the row count), so speculation could change outputs")
    return "bfloat16", (f"bfloat16 (exact attention, passes of at most {invariant_rows} rows): faster here by "
                        f"measurement and batch-invariant, {detail}")


def _order_sensitive(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, k]`` float32 inputs whose dot product with a row of ones depends on the order
    of summation: small terms (+-1 to +-32) between pairs of +-2^30 at random places, so a
    running sum that holds a big term absorbs the small ones and another order (other lanes,
    blocking or unrolling) absorbs others. On random activations a kernel's changed order shows
    only when a bf16 rounding happens to flip (an AMD EPYC's 64x64 bf16 linear differed from 2
    rows with these inputs, on the model's own activations only at some prompts)."""
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
def linear_invariant_rows(model: PreTrainedModel, limit: int = PROBE_ROWS, kernels: str = "default") -> int:
    """The largest ``r <= limit`` such that every linear layer shape of ``model``, run by these
    ``kernels`` in the model's dtype, gives each row of an ``n``-row product (``n`` in ``2..r``)
    bitwise its one-row result, on :func:`_order_sensitive` inputs (weights of ones), on each
    layer's own device (the inputs are drawn on the CPU and moved there)."""
    gen = torch.Generator().manual_seed(0)
    layers = linear_layers([model])
    shapes = {(tuple(layer.weight.shape), layer.weight.dtype, layer.weight.device) for layer in layers}
    if kernels == "onednn":  # and the stacked products of sibling layers (kernels._Siblings)
        shapes |= {((sum(layer.out_features for layer in group), group[0].in_features), group[0].weight.dtype,
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
    may change blocking with the row count (one AMX Xeon: bf16 linears invariant up to 32 rows,
    not above), so the engine verifies at most this many rows per pass. Two probes, the smaller
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


def _bf16_supported(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def measure_dtypes(model: PreTrainedModel, prefix: int = 128, reps: int = 5,
                   ) -> tuple[dict[str, dict[int, float]], int | None]:
    """Pass cost by new-token count for ``model`` (float32) and a bfloat16 copy of it with
    exact attention, and the copy's :func:`invariant_rows` when bfloat16 is the faster (else
    None). ``model`` is left as it was."""
    device = model.get_output_embeddings().weight.device
    if not _bf16_supported(device):
        return {"float32": measure_cost(model, list(SIZES), prefix=prefix, reps=reps)}, None
    half = copy.deepcopy(model).to(torch.bfloat16)
    set_exact(half, True)
    costs = measure_costs({"float32": (model, nullcontext()), "bfloat16": (half, nullcontext())}, list(SIZES),
                          prefix=prefix, reps=reps)  # round-robin: a slow spell falls on both
    rows = invariant_rows(half) if costs["bfloat16"][16] < MARGIN * costs["float32"][16] else None
    del half
    return costs, rows


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, all CPUs summed (Linux's
    ``/proc/stat``: steal counts as busy, idle and iowait as idle); None where it cannot be read."""
    try:
        ticks = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - sum(ticks[3:5])) / hz, sum(ticks) / hz


@contextmanager
def others_load(share: list[float]):
    """Append to ``share`` the fraction of the machine's CPU time that *other* processes used
    while the block ran (this process's own threads excluded; nothing where /proc/stat is absent)."""
    before, own = _cpu_seconds(), time.process_time()
    yield
    after = _cpu_seconds()
    if before is not None and after is not None and after[1] > before[1]:
        others = (after[0] - before[0]) - (time.process_time() - own)
        share.append(max(0.0, others) / (after[1] - before[1]))


def _busy_now(seconds: float = 0.25) -> bool:
    share: list[float] = []
    with others_load(share):
        time.sleep(seconds)
    return bool(share) and share[0] >= BUSY_SHARE


def _cached(cache_file: Path, key: str, measure, timed: bool = True) -> tuple[dict, bool]:
    """The entry for ``key`` in the JSON table ``cache_file``, else ``measure()``'s (a dict),
    stored atomically: two processes never leave half a file. Returns (entry, was cached).
    A timing taken while other processes used a good part of the CPUs is off (seen: both
    kernels at 115-117 ms for one token under load, 93 and 135 ms idle, so the pick flipped):
    such an entry is marked and measured again by the first call that finds the machine idle
    (``timed=False``: ``measure`` is not a timing, e.g. an exactness probe)."""
    table = _read_table(cache_file)
    if key in table and ("busy_share" not in table[key] or _busy_now()):
        return table[key], True
    share: list[float] = []
    with others_load(share):
        entry = measure()
    if timed and share and share[0] >= BUSY_SHARE:
        note = f"timed while other processes used {share[0]:.0%} of the CPUs: timed again once the machine is idle"
        entry = {**entry, "busy_share": round(share[0], 3)}
        if "reason" in entry:
            entry["reason"] = f"{entry['reason']}; {note}"
    table = _read_table(cache_file)  # another process may have written
    table[key] = entry
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(cache_file) as tmp:
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    return entry, False


def _read_table(cache_file: Path) -> dict:
    """The measurement table in ``cache_file`` ({} if absent). A damaged one (cut off, garbage,
    not an object of entries) is dropped with one warning line and measured again."""
    if not cache_file.exists():
        return {}
    try:
        table = read_json(cache_file, "")
    except MedusaError:
        table = None
    if isinstance(table, dict) and all(isinstance(v, dict) for v in table.values()):
        return table
    drop_cache_entry(cache_file, "damaged (not a JSON table of entries)")
    return {}


def _costs(entry: dict) -> dict[str, dict[int, float]]:
    return {d: {int(n): ms for n, ms in c.items()} for d, c in entry["cost_ms"].items()}


def pick_dtype(model: PreTrainedModel, cache_file: Path) -> DtypeChoice:
    """The dtype to run ``model`` (loaded in float32) in on its device: cached, else measured."""
    device = model.get_output_embeddings().weight.device
    key = f"{device_key(device)} | {model_key(model)} | {KEY_VERSION}"

    def measure() -> dict:
        costs, rows = measure_dtypes(model)
        dtype, reason = decide(costs, rows)
        return asdict(DtypeChoice(dtype, reason, costs, rows))

    entry, cached = _cached(cache_file, key, measure)
    return DtypeChoice(entry["dtype"], entry["reason"] + (" (cached)" if cached else ""), _costs(entry),
                       entry.get("invariant_rows"))


@contextmanager
def _exact(model: PreTrainedModel):
    """``model`` with exact attention on (how a half-precision engine runs it), then as it was."""
    was = is_exact(model)
    set_exact(model, True)
    try:
        yield model
    finally:
        set_exact(model, was)


def exact_rows(model: PreTrainedModel, cache_file: Path, kernels: str = "default") -> int:
    """For a half-precision model: the largest exact pass on this device with these linear
    ``kernels``, probed once with exact attention (:func:`invariant_rows`) and cached."""
    device = model.get_output_embeddings().weight.device
    key = f"rows | {device_key(device)} | {model_key(model)} | {model.dtype} | {kernels_key(kernels)} | {KEY_VERSION}"

    def measure() -> dict:
        with _exact(model), (PackedLinears(model) if kernels == "onednn" else nullcontext()):
            return {"invariant_rows": invariant_rows(model, kernels=kernels)}

    return int(_cached(cache_file, key, measure, timed=False)[0]["invariant_rows"])


def adopt_picked_dtype(model: PreTrainedModel, cache_file: Path) -> DtypeChoice | None:
    """For a model loaded in float32 with no dtype asked for: convert it to the picked dtype
    (in place) and record the choice as ``model.dtype_choice`` for banners. Models loaded in
    another dtype (a bf16 checkpoint on a GPU) are left alone: None."""
    if model.dtype != torch.float32:
        return None
    choice = pick_dtype(model, cache_file)
    if choice.dtype == "bfloat16":
        model.to(torch.bfloat16)
    model.dtype_choice = choice
    return choice


@dataclass(frozen=True)
class KernelChoice:
    kernels: str  # "default" or "onednn" (medusa/runtime/kernels.py)
    reason: str  # one line for the chat banner and the bench
    cost_ms: dict[str, dict[int, float]]  # kernels -> {new tokens: ms per pass}
    invariant_rows: int | None = None  # half precision, packed: exact passes up to this many rows


def decide_kernels(cost_ms: dict[str, dict[int, float]], invariant_rows: int | None = None,
                   half: bool = False) -> tuple[str, str]:
    """``(kernels, reason)``: packed oneDNN linears only if their one-token pass plus 16-node
    pass cost under ``MARGIN`` of the default kernels' (torch's own: MKL for float32 on a CPU)
    and, for a ``half``-precision model, passes of at least ``MIN_ROWS`` rows stay exact with
    them (``invariant_rows``)."""
    if "onednn" not in cost_ms:
        return "default", "default linear kernels: this device has no packed oneDNN linears"
    detail = " vs ".join(f"{k} T(1)={c[1]:.1f} T(16)={c[16]:.1f} ms" for k, c in cost_ms.items())
    if sum(cost_ms["onednn"].values()) >= MARGIN * sum(cost_ms["default"].values()):
        return "default", f"default linear kernels: oneDNN's are not faster here by measurement, {detail}"
    if half and (invariant_rows is None or invariant_rows < MIN_ROWS):
        return "default", (f"default linear kernels: oneDNN's are faster here ({detail}) but not exact: "
                           f"a pass of {(invariant_rows or 1) + 1} rows differs from its one-token passes")
    exact = f", exact up to {invariant_rows} rows" if half else ""
    return "onednn", f"oneDNN linear kernels: faster here by measurement{exact}, {detail}"


def measure_kernels(model: PreTrainedModel, prefix: int = 128, reps: int = 7) -> dict[str, dict[int, float]]:
    """Pass cost by new-token count with the default and with packed oneDNN linears (for a
    half-precision model with exact attention, as its engine runs it), timed round-robin."""
    device = model.get_output_embeddings().weight.device
    variants = {"default": (model, nullcontext())}
    if onednn_available(device, model.dtype):
        variants["onednn"] = (model, PackedLinears(model))
    with _exact(model) if model.dtype != torch.float32 else nullcontext():
        return measure_costs(variants, list(SIZES), prefix=prefix, reps=reps)


def pick_kernels(model: PreTrainedModel, cache_file: Path, rows_file: Path | None = None) -> KernelChoice:
    """The linear kernels for ``model`` (in its dtype) on its device: cached, else measured.
    A half-precision model's packed kernels are probed for exactness (:func:`exact_rows`,
    cached in ``rows_file``, default ``cache_file``). Not a CPU: the default kernels, unmeasured."""
    device = model.get_output_embeddings().weight.device
    if not onednn_available(device, model.dtype):
        where = f"this CPU and torch build in {model.dtype}" if device.type == "cpu" else f"{device}"
        return KernelChoice("default", f"default linear kernels: no packed oneDNN linears on {where}", {})
    key = f"{device_key(device)} | {model_key(model)} | {model.dtype} | {KERNEL_KEY_VERSION}"
    half = model.dtype != torch.float32

    def measure() -> dict:
        costs = measure_kernels(model)
        rows = None
        if half and decide_kernels(costs, MIN_ROWS, half)[0] == "onednn":  # faster: is it exact?
            rows = exact_rows(model, rows_file or cache_file, "onednn")
        return asdict(KernelChoice(*decide_kernels(costs, rows, half), costs, rows))

    entry, cached = _cached(cache_file, key, measure)
    return KernelChoice(entry["kernels"], entry["reason"] + (" (cached)" if cached else ""), _costs(entry),
                        entry.get("invariant_rows"))


@dataclass(frozen=True)
class DraftDtypeChoice:
    dtype: str  # the heads' dtype: "float32" or "bfloat16" (or "int8" weights, asked for: EagleHeads.to_int8)
    reason: str  # one line for the chat banner and the bench
    cost_ms: dict[str, float]  # dtype -> ms to score DRAFT_ROWS features over the draft vocabulary


def measure_draft_scoring(hidden: int, rows: int, device: torch.device, reps: int = 20) -> dict[str, float]:
    """Median ms to score ``DRAFT_ROWS`` features against ``rows`` vocabulary rows of width
    ``hidden`` (the heads' dominant drafting cost), in float32 and in bfloat16 (where supported).
    Random weights: only the shapes and the kernels matter."""
    import time

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    costs = {}
    dtypes = (torch.float32, torch.bfloat16) if _bf16_supported(device) else (torch.float32,)
    for dtype in dtypes:
        gen = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
        x = torch.randn(DRAFT_ROWS, hidden, generator=gen).to(device=device, dtype=dtype)
        times = []
        with torch.inference_mode():
            for i in range(reps + 3):
                sync()
                t0 = time.perf_counter()
                _ = x @ w.T
                sync()
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


def pick_draft_dtype(model: PreTrainedModel, heads, cache_file: Path) -> DraftDtypeChoice:
    """The dtype for ``heads`` drafting beside ``model``: the target's own unless the target is
    float32, then bfloat16 where it scores the draft vocabulary faster (cached, else measured)."""
    device = model.get_output_embeddings().weight.device
    if model.dtype != torch.float32:
        return DraftDtypeChoice(str(model.dtype).removeprefix("torch."), "the target's dtype", {})
    vocab, hidden = model.get_output_embeddings().weight.shape
    rows = len(heads.draft_vocab) if heads.draft_vocab is not None else vocab
    key = f"{device_key(device)} | h{hidden} rows{rows} | {DRAFT_KEY_VERSION}"

    def measure() -> dict:
        costs = measure_draft_scoring(hidden, rows, device)
        return asdict(DraftDtypeChoice(*decide_draft_dtype(costs), costs))

    entry, cached = _cached(cache_file, key, measure)
    return DraftDtypeChoice(entry["dtype"], entry["reason"] + (" (cached)" if cached else ""), entry["cost_ms"])


def adopt_draft_dtype(heads, model: PreTrainedModel, cache_file: Path, dtype: torch.dtype | str | None = None,
                      ) -> DraftDtypeChoice:
    """Convert ``heads`` (in place) to ``dtype``, or to the picked draft dtype when None, and
    return the choice. Do it before an engine packs the heads' kernels."""
    if dtype is None:
        choice = pick_draft_dtype(model, heads, cache_file)
    else:
        name = str(dtype).removeprefix("torch.")
        if name not in ("float32", "bfloat16", "float16", "int8"):
            from medusa.errors import MedusaError

            raise MedusaError(f"draft_dtype must be float32, bfloat16, float16 or int8, got {dtype!r}")
        choice = DraftDtypeChoice(name, "asked for", {})
    if choice.dtype == "int8":
        if heads.config.kind != "eagle":
            from medusa.errors import MedusaError

            raise MedusaError("draft_dtype int8 is for eagle heads (their linears and draft vocabulary run on int8 "
                              "weights): use bfloat16 for Medusa heads")
        heads.to_int8()
    else:
        heads.to(getattr(torch, choice.dtype))
    return choice
