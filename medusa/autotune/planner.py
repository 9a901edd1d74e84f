"""The machine plan, built once per load: what ``medusa.load()`` measures, in order.

1. the target's dtype (medusa/autotune/dtype.py: capability, exactness, a large speed gap);
2. the linear kernels on a CPU (torch's default, packed oneDNN weights or, in float32, the gemv
   kernels, by timing the pass);
3. in half precision, the rows per pass that stay exact (the invariance probe on the model);
4. the heads' drafting dtype (the draft vocabulary's scoring in float32 and bfloat16);
5. EAGLE trees and hybrid's lookup chain, sized from this machine's pass costs.

``autotune=True`` measures what the cache lacks and stores it; ``"cached"`` reads the cache
and takes the defaults for the rest (measuring nothing); ``False`` reads nothing, writes nothing
and takes :meth:`~medusa.decoding.plan.Plan.default`. What the caller asks for (``dtype=``,
``kernels=``, ``draft_dtype=``) wins over every step and is recorded with reason "asked for".
The target and heads are converted here (dtype, heads' dtype) before the engine is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from medusa.autotune import device as probes
from medusa.autotune.cache import PlanCache, cpu_flags, key
from medusa.autotune.drawn import calibrated_drawn, describe_drawn, drawn_records, drawn_table
from medusa.autotune.dtype import MIN_ROWS, RATIO_ROWS, dtype_rule, native_bf16
from medusa.autotune.sizing import (
    CONTEXTS,
    curves_by_context,
    faster_curve,
    heads_fingerprint,
    measure_sizes,
    sizable,
    sizes_from,
)
from medusa.decoding.passes.strategies import kernel_scope
from medusa.decoding.plan import DEFAULT_REASON, Decision, Plan
from medusa.errors import MedusaError
from medusa.models.kinds import kind
from medusa.runtime import drafter, gemv
from medusa.runtime.exact import pass_rows, set_exact
from medusa.runtime.kernels import PackedLinears, kernels_key, onednn_available

AUTOTUNE = (True, False, "cached")
DRAFT_DTYPES = ("float32", "bfloat16", "float16", "int8")


def _name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _drafting(heads) -> str:
    """How ``heads``' layer drafts here, part of the sizes' cache key: its timed cost depends on it."""
    return "drafter one-call" if heads is not None and drafter.supported(heads) is None else "drafter modules"


class Planner:
    """One load's plan steps over one cache; ``measured`` counts the measurements it ran."""

    def __init__(self, autotune: bool | str = True, cache: PlanCache | None = None, retime: bool = True) -> None:
        if autotune not in AUTOTUNE:
            raise MedusaError(f"autotune must be True, False or 'cached', got {autotune!r}")
        self.autotune = autotune
        self.retime = retime  # autotune=True: a cached pass curve is timed again where the machine is faster now
        self.stale: tuple | None = None  # what refresh() re-sizes from: the cached entry, the plan before the trees...
        self.cache = cache if cache is not None else PlanCache()
        self.measured: list[str] = []
        self.pass_ms: dict[int, float] = {}  # the picked kernels' pass cost by rows, as the kernel pick timed it

    def entry(self, name: str, fields: tuple[str, ...], measure: Callable[[], dict],
              timed: bool = True) -> tuple[dict | None, bool]:
        """``(entry, cached)``: the cache's entry (re-timed where it was timed on a busy machine
        and this one is idle), else measured with ``autotune=True``; ``(None, False)`` otherwise."""
        if self.autotune is False:
            return None, False
        found = self.cache.get(name, fields)
        if found is not None and ("busy_share" not in found or self.autotune == "cached" or self.cache.busy_now()):
            return found, True
        if self.autotune == "cached":
            return None, False
        self.measured.append(name.split(" | ", 1)[0])
        return self.cache.measure(name, measure, timed), False

    def decision(self, name: str, value, entry: dict, cached: bool) -> Decision:
        """A measured ``entry``'s decision: its cost now (0 when read from the cache)."""
        note = f" (cached; measured in {entry['seconds']:.1f} s)" if cached else ""
        busy = f"; timed while others used {entry['busy_share']:.0%} of the CPUs: timed again once idle" \
            if "busy_share" in entry else ""
        return Decision(name, value, entry["reason"] + busy + note, 0.0 if cached else entry["seconds"])

    # -- 1. dtype -------------------------------------------------------------------------
    def dtype(self, lm, asked: bool, compile) -> Decision:
        """Pick the target's dtype and convert ``lm`` to it (only a float32-loaded target)."""
        here = _name(lm.dtype)
        if asked:
            return Decision("dtype", here, "asked for")
        if lm.dtype != torch.float32:
            return Decision("dtype", here, "as loaded (the checkpoint's dtype)")
        if compile and compile != "auto" and lm.device.type != "cpu":
            return Decision("dtype", here, f"compile=True on {lm.device.type}: the loaded dtype is kept "
                                           "(compiled passes are exact in float32 only there)")
        native, why = native_bf16(lm.device, cpu_flags())
        if not native or self.autotune is False:
            return Decision("dtype", "float32", dtype_rule(native, why)[1] if native is False else DEFAULT_REASON)

        def measure() -> dict:
            rows = probes.linear_invariant_rows(lm, dtype=torch.bfloat16)
            ratios = {}
            if rows >= MIN_ROWS:  # one-row passes (plain decoding, a step whose draft is empty) and a tree's
                for n in RATIO_ROWS:
                    cost = probes.linear_seconds(lm, (torch.float32, torch.bfloat16), rows=n)
                    ratios[str(n)] = cost["bfloat16"] / cost["float32"]
            dtype, reason = dtype_rule(native, why, rows, max(ratios.values(), default=None))
            return {"dtype": dtype, "reason": reason, "linear_rows": rows, "ratios": ratios}

        entry, cached = self.entry(key("dtype", lm.device, lm), ("dtype", "reason", "ratios"), measure)
        if entry is None:
            return Decision("dtype", "float32", DEFAULT_REASON)
        if entry["dtype"] == "bfloat16":
            lm.to(torch.bfloat16)
        return self.decision("dtype", entry["dtype"], entry, cached)

    # -- 2. kernels -----------------------------------------------------------------------
    def kernels(self, lm, asked: str | None) -> tuple[Decision, int | None]:
        """The linear kernels, and (half precision, packed) the rows they keep exact."""
        if asked is not None:
            return Decision("kernels", asked, "asked for"), None
        # gemv's first use builds it: before the timing, or the C compiler, another process, reads
        # as load on the machine and the pick is marked busy, to be timed again at the next load
        has_gemv = gemv.available(lm.device, lm.dtype)
        if not onednn_available(lm.device, lm.dtype) and not has_gemv:
            where = f"this CPU and torch build in {lm.dtype}" if lm.device.type == "cpu" else f"{lm.device}"
            return Decision("kernels", "default", f"no packed oneDNN linears on {where}"), None
        half = lm.dtype != torch.float32

        def measure() -> dict:
            costs = probes.measure_kernels(lm)
            rows = None
            if half and probes.decide_kernels(costs, MIN_ROWS, half)[0] == "onednn":  # faster: is it exact?
                rows = _probe_rows(lm, "onednn")
            pick, reason = probes.decide_kernels(costs, rows, half)
            return {"kernels": pick, "reason": reason, "cost_ms": costs, "invariant_rows": rows}

        entry, cached = self.entry(key("kernels", lm.device, lm, _name(lm.dtype), kernels_key("onednn")),
                                   ("kernels", "reason"), measure)
        if entry is None:
            return Decision("kernels", "default", DEFAULT_REASON), None
        self.pass_ms = {int(n): float(ms) for n, ms in (entry.get("cost_ms") or {}).get(entry["kernels"], {}).items()}
        return self.decision("kernels", entry["kernels"], entry, cached), entry.get("invariant_rows")

    # -- 3. exact rows --------------------------------------------------------------------
    def rows(self, lm, kernels: str, probed: int | None) -> Decision | None:
        """Half precision: the largest pass the engine may verify exactly (None in float32)."""
        if lm.dtype not in (torch.bfloat16, torch.float16):
            return None
        if probed is not None and kernels == "onednn":
            return Decision("rows", probed, "exact with packed kernels (probed with the kernel pick)")

        def measure() -> dict:
            rows = _probe_rows(lm, kernels)
            return {"rows": rows, "reason": f"passes of up to {rows} rows give each row its one-row logits"}

        entry, cached = self.entry(key("rows", lm.device, lm, _name(lm.dtype), kernels_key(kernels)),
                                   ("rows", "reason"), measure, timed=False)
        if entry is None:
            return Decision("rows", None, f"{DEFAULT_REASON}: exact attention's own cap")
        return self.decision("rows", entry["rows"], entry, cached)

    # -- 4. heads' dtype ------------------------------------------------------------------
    def draft_dtype(self, lm, heads, asked) -> Decision:
        if asked is not None:
            name = _name(asked)
            if name not in DRAFT_DTYPES:
                raise MedusaError(f"draft_dtype must be float32, bfloat16, float16 or int8, got {asked!r}")
            return Decision("draft_dtype", name, "asked for")
        if lm.dtype != torch.float32:
            return Decision("draft_dtype", _name(lm.dtype), "the target's dtype")
        hidden = lm.get_output_embeddings().weight.shape[1]
        rows = len(heads.draft_vocab) if heads.draft_vocab is not None else lm.get_output_embeddings().weight.shape[0]

        def measure() -> dict:
            costs = probes.measure_draft_scoring(hidden, rows, lm.device)
            dtype, reason = probes.decide_draft_dtype(costs)
            return {"dtype": dtype, "reason": reason, "cost_ms": costs}

        entry, cached = self.entry(key("draft_dtype", lm.device, None, f"h{hidden} rows{rows}"),
                                   ("dtype", "reason"), measure)
        if entry is None:
            return Decision("draft_dtype", "float32", f"{DEFAULT_REASON}: the target's dtype")
        return self.decision("draft_dtype", entry["dtype"], entry, cached)

    # -- 5. trees -------------------------------------------------------------------------
    def trees(self, lm, heads, plan: Plan, compile) -> Plan:
        curves = sizable(heads, lm.device, lm.dtype, compile)
        if not curves:  # static trees: sampled requests' drawn chains from the kernel pick's pass costs
            drawn = calibrated_drawn(heads, lm.device, lm.dtype, self.pass_ms)
            reason = "calibrated for the device type" + describe_drawn(drawn, heads.config.kind)
            # the pass costs the kernel pick timed: a batch's row budget and a lone sequence's check of
            # what its rows cost read them (None where nothing was timed)
            timed = tuple(sorted(self.pass_ms.items())) or None
            return plan.decided(Decision("trees", "calibrated", reason), drawn=drawn, pass_ms=timed)
        exact = plan.exact if plan.exact is not None else lm.dtype in (torch.bfloat16, torch.float16)
        max_rows = pass_rows(exact, plan.max_rows)

        def measure() -> dict:
            with _exact(lm, exact):
                return measure_sizes(lm, heads, kernel_scope(lm, plan.kernels, None, heads), max_rows, sorted(curves))

        name = key("sizes", lm.device, lm, _name(lm.dtype), kernels_key(plan.kernels), f"rows {max_rows}",
                   heads_fingerprint(heads), f"contexts {','.join(map(str, CONTEXTS))}", _drafting(heads),
                   f"shapes {','.join(f'{d}x{k}' for d, k in sorted(curves))}")  # each shape's drafting is timed
        entry, cached = self.entry(name, ("cost_ms", "draft_ms"), measure)
        if entry is None:
            return plan.decided(Decision("trees", "calibrated", DEFAULT_REASON))
        if cached and self.retime and self.autotune is True:  # checked once the engine is built: refresh()
            self.stale = (name, entry, plan, compile, curves, max_rows)
        return self._sized(lm, heads, plan, entry, cached, compile, curves, max_rows)

    def refresh(self, engine):
        """With ``engine`` built (its kernels packed once), time its cached pass curve again where
        this machine runs a one-row pass clearly faster now than the curve says
        (:func:`~medusa.autotune.sizing.faster_curve`), store it and size the engine's trees from
        it. Returns ``engine``."""
        if self.stale is None:
            return engine
        name, entry, plan, compile, curves, max_rows = self.stale
        self.stale = None
        faster = faster_curve(engine.model, engine.kernel_scope(), entry)
        if faster is not None:
            self.cache.put(name, faster)
            engine.plan = self._sized(engine.model, engine.heads, plan, faster, True, compile, curves, max_rows)
        return engine

    def _sized(self, lm, heads, plan: Plan, entry: dict, cached: bool, compile, curves: dict,
               max_rows: int | None) -> Plan:
        """``plan`` with the trees sized from the timings ``entry``, the acceptance ``curves`` and
        passes of at most ``max_rows`` rows."""
        sizes = sizes_from(entry, curves, max_rows, compiled=bool(compile), device_type=lm.device.type,
                           by_context=curves_by_context(heads, lm.device, lm.dtype))
        drawn = drawn_table(drawn_records(heads, lm.device, lm.dtype), sizes.cost_ms)
        value = f"eagle {sizes.eagle.nodes} nodes, hybrid {sizes.hybrid.nodes} nodes" + describe_drawn(drawn)
        decision = self.decision("trees", value, {**entry, "reason": sizes.reason}, cached)
        return plan.decided(decision, eagle=sizes.eagle, hybrid=sizes.hybrid, lookahead=sizes.lookahead,
                            pass_ms=tuple(sorted(sizes.cost_ms.items())), drawn=drawn,
                            pass_ms_by_length=tuple((n, tuple(sorted(c.items()))) for n, c in sorted(sizes.cost_by_length.items())))


@contextlib.contextmanager
def _exact(lm, on: bool):
    from medusa.runtime.exact import is_exact

    was = is_exact(lm)
    set_exact(lm, on)
    try:
        yield
    finally:
        set_exact(lm, was)


def _probe_rows(lm, kernels: str) -> int:
    """The model's exact rows with exact attention and these kernels (device.invariant_rows)."""
    with _exact(lm, True), (PackedLinears(lm) if kernels == "onednn" else contextlib.nullcontext()):
        return probes.invariant_rows(lm, kernels=kernels)


def adopt_draft_dtype(heads, dtype: str | None) -> None:
    """Convert ``heads`` (in place) to ``dtype`` before an engine packs their kernels."""
    if dtype is None:
        return
    if dtype == "int8":
        if not kind(heads.config.kind).int8:
            raise MedusaError("draft_dtype int8 is for eagle heads (their linears and draft vocabulary run on int8 "
                              "weights): use bfloat16 for Medusa heads")
        heads.to_int8()
    else:
        heads.to(getattr(torch, dtype))


def make_plan(lm, heads, *, autotune: bool | str = True, dtype_asked: bool = False, kernels: str | None = None,
              draft_dtype=None, compile=False, base: Plan | None = None, planner: Planner | None = None) -> Plan:
    """The plan for ``lm`` (converted here to the picked dtype) and ``heads`` (converted to the
    heads' dtype). ``base``: a plan whose target decisions (dtype, kernels, rows) stand, for a
    target an engine already runs (``medusa.load(target=engine)``)."""
    planner = planner or Planner(autotune)
    if base is not None:
        plan = Plan(dtype=_name(lm.dtype), kernels=kernels or base.kernels, exact=base.exact, max_rows=base.max_rows,
                    decisions=tuple(d for d in base.decisions if d.name in ("dtype", "kernels", "rows")))
        if kernels is not None:
            plan = plan.decided(Decision("kernels", kernels, "asked for"))
    else:
        plan = Plan().decided(planner.dtype(lm, dtype_asked, compile), dtype=_name(lm.dtype))
        chosen, probed = planner.kernels(lm, kernels)
        plan = plan.decided(chosen, kernels=chosen.value)
        rows = planner.rows(lm, plan.kernels, probed)
        if rows is not None:
            plan = plan.decided(rows, max_rows=rows.value)
    if heads is None:
        return plan
    chosen = planner.draft_dtype(lm, heads, draft_dtype)
    adopt_draft_dtype(heads, chosen.value)
    return planner.trees(lm, heads, plan.decided(chosen, draft_dtype=chosen.value), compile)
