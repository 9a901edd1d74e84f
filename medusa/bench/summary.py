"""A bench run's numbers: tokens/s, speedup, tau and identical outputs per mode (``summarise``),
where the engine modes' steps went, and the table the bench prints."""

from __future__ import annotations

from medusa.bench.prompts import Prompt
from medusa.bench.records import Run
from medusa.bench.runners import PLAIN_DTYPES


def summarise(prompts: list[Prompt], runs: dict[str, list[Run]], reference: str | None, sampled: bool = False) -> dict:
    out: dict[str, dict] = {}
    ref_tps = None
    if reference in runs:
        ref_tps = sum(len(r.tokens) for r in runs[reference]) / max(sum(r.seconds for r in runs[reference]), 1e-9)
    for name, rs in runs.items():
        tokens = sum(len(r.tokens) for r in rs)
        seconds = sum(r.seconds for r in rs)
        steps = [r.steps for r in rs if r.steps is not None]
        tps = tokens / seconds if seconds else 0.0
        decode = after_first(rs)
        same = same_base = None
        if reference in runs and name != reference and not sampled:
            same = sum(r.tokens == ref.tokens for r, ref in zip(rs, runs[reference]))
        if "baseline" in runs and name not in (reference, "baseline") and not sampled:
            # the engine's own promise: speculation never changes what plain decoding emits
            same_base = sum(r.tokens == b.tokens for r, b in zip(rs, runs["baseline"]))
        categories: dict[str, dict] = {}
        for p, r in zip(prompts, rs):
            c = categories.setdefault(p.category, {"tokens": 0, "seconds": 0.0})
            c["tokens"] += len(r.tokens)
            c["seconds"] += r.seconds
        out[name] = {
            "tokens": tokens, "seconds": seconds, "tokens_per_second": tps,
            "speedup": tps / ref_tps if ref_tps else None, "decode_tokens_per_second": decode,
            "tau": tokens / sum(steps) if len(steps) == len(rs) and sum(steps) else None,
            "identical": same, "identical_baseline": same_base, "sampled": sampled, "prompts": len(rs),
            "step_ms": step_profile(rs),
            "categories": {k: {**v, "tokens_per_second": v["tokens"] / v["seconds"] if v["seconds"] else 0.0}
                           for k, v in categories.items()},
            "per_prompt": [{"id": p.id, "category": p.category, "tokens": r.tokens, "seconds": r.seconds, "steps": r.steps,
                            "accepted": r.accepted, "first_seconds": r.first_seconds, "plain_steps": r.plain_steps,
                            "lean_steps": r.lean_steps}
                           for p, r in zip(prompts, rs)],
        }
    return out


def after_first(rs: list) -> float | None:
    """Tokens/s after each answer's first token (the decoding alone, its prompt's pass left out),
    over runs or per-prompt records that all say when their first token came; else None."""
    def get(r, key):
        return r[key] if isinstance(r, dict) else getattr(r, key)

    if not rs or any(get(r, "first_seconds") is None for r in rs):
        return None
    tokens = sum(max(len(get(r, "tokens")) - 1, 0) for r in rs)
    seconds = sum(get(r, "seconds") - get(r, "first_seconds") for r in rs)
    return tokens / seconds if seconds > 0 else None


def step_profile(rs: list[Run]) -> dict[str, float] | None:
    """Milliseconds per decode step in each phase, over a mode's prompts (engine modes): the
    proposer's drafting, the verification pass (acceptance and cache bookkeeping included), the
    proposer's update, and the rest of the loop; None for modes that do not report phases."""
    if not rs or any(r.phases is None for r in rs):
        return None
    steps = sum(r.steps - 1 for r in rs)  # Run.steps counts the prefill's pass
    if steps <= 0:
        return None
    ms = {k: sum(r.phases[k] for r in rs) * 1e3 / steps for k in ("draft", "verify", "update")}
    ms["other"] = max(0.0, (sum(r.seconds - sum(r.phases.values()) for r in rs)) * 1e3 / steps)
    return ms


def profile_lines(summary: dict) -> list[str]:
    """One line per engine mode: where a decode step's time went (see :func:`step_profile`)."""
    lines = []
    for name, s in summary.items():
        ms = s.get("step_ms")
        if ms:
            total = sum(ms.values())
            parts = " + ".join(f"{k} {v:.1f}" + (f" ({v / total:.0%})" if k == "verify" else "") for k, v in ms.items())
            prompts = s.get("per_prompt") or []
            plain, steps = sum(p.get("plain_steps") or 0 for p in prompts), sum((p.get("steps") or 1) - 1 for p in prompts)
            lean = sum(p.get("lean_steps") or 0 for p in prompts)
            said = f"; {plain} of {steps} steps plain (drafting did not pay)" if plain else ""
            said += f"; {lean} of {steps} steps lean (the heads did not pay)" if lean else ""
            lines.append(f"step profile, {name}: {total:.1f} ms per step = {parts}{said}")
    return lines


TRANSFORMERS_PEERS = ("hf", "hf-compile", *(f"hf-{d}" for d in PLAIN_DTYPES))  # plain generate, as a user runs it


def against_fastest_peer(summary: dict) -> str | None:
    """A line naming the fastest plain transformers ``generate`` of the run (where several
    ran: ``hf`` and ``hf-float32``, say) and every other mode's speed as a multiple of it."""
    peers = {name: s["tokens_per_second"] for name, s in summary.items() if name in TRANSFORMERS_PEERS}
    if len(peers) < 2:
        return None
    best = max(peers, key=peers.get)
    others = ", ".join(f"{name} {s['tokens_per_second'] / peers[best]:.2f}x" for name, s in summary.items()
                       if name not in peers and peers[best] > 0)
    return f"fastest transformers generate here: {best} ({peers[best]:.1f} tokens/s)" + (f"; {others}" if others else "")


def table(summary: dict, reference: str | None) -> str:
    head = f"| mode | tokens/s | speedup vs {reference or '-'} | tau | identical to {reference or '-'} |"
    lines = [head, "|---|---|---|---|---|"]
    for name, s in summary.items():
        speed = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
        if name == reference:
            same = "(reference)"
        elif s["identical"] is None:
            same = "n/a (sampled)" if s.get("sampled") else "-"
        else:
            same = f"{'yes' if s['identical'] == s['prompts'] else 'NO'} ({s['identical']}/{s['prompts']})"
        base = s.get("identical_baseline")
        if base is not None:
            same += f"; baseline: {'yes' if base == s['prompts'] else 'NO'} ({base}/{s['prompts']})"
        lines.append(f"| {name} | {s['tokens_per_second']:.1f} | {speed} | {tau} | {same} |")
    return "\n".join(lines)


def temperature_table(summaries: dict[float, dict]) -> list[str]:
    """Mode by temperature: tokens/s, tau and the speedup over ``baseline`` (where it ran)."""
    temps = list(summaries)
    lines = ["| mode | " + " | ".join(f"T={t:g} tok/s (x baseline, tau)" for t in temps) + " |",
             "|---" * (len(temps) + 1) + "|"]
    for mode in next(iter(summaries.values())):
        cells = []
        for t in temps:
            s, base = summaries[t][mode], summaries[t].get("baseline")
            ratio = f"{s['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "-"
            cells.append(f"{s['tokens_per_second']:.1f} ({ratio}, {s['tau']:.2f})")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def length_table(summary: dict, decode: bool = False) -> list[str]:
    """Mode by prompt length, where every prompt's category ends in one (``rag-2k``, as
    docs/benchmarks/prompts/long-context.jsonl names them): tokens/s, the speedup over ``baseline``
    where it ran, and tau, per length. ``decode``: tokens/s after each answer's first token (the
    decoding alone: a long prompt's pass is most of a short answer's time; "-" for modes that do
    not say when their first token came). Empty for prompts without lengths."""
    first = next(iter(summary.values()), None)
    if first is None:
        return []
    lengths = [p["category"].rsplit("-", 1)[-1] for p in first["per_prompt"]]
    if not all(n[:-1].isdigit() and n.endswith("k") for n in lengths):
        return []
    order = sorted(set(lengths), key=lambda n: int(n[:-1]))
    rows = {}
    for mode, s in summary.items():
        rows[mode] = {}
        for n in order:
            runs = [p for p in s["per_prompt"] if p["category"].endswith(f"-{n}")]
            tokens, seconds = sum(len(p["tokens"]) for p in runs), sum(p["seconds"] for p in runs)
            steps = [p["steps"] for p in runs if p["steps"] is not None]
            tau = tokens / sum(steps) if len(steps) == len(runs) and sum(steps) else None
            tps = after_first(runs) if decode else (tokens / seconds if seconds else 0.0)
            rows[mode][n] = (tps, tau)
    what = "after the first token: tok/s (x baseline, tau)" if decode else "tok/s (x baseline, tau)"
    lines = ["| mode | " + " | ".join(f"{n} tokens: {what}" for n in order) + " |",
             "|---" * (len(order) + 1) + "|"]
    for mode, cells in rows.items():
        text = []
        for n in order:
            tps, tau = cells[n]
            if tps is None:
                text.append("-")
                continue
            base = rows.get("baseline", {}).get(n, (None, None))[0]
            ratio = f"{tps / base:.2f}x" if base else "-"
            text.append(f"{tps:.1f} ({ratio}, {tau:.2f})" if tau is not None else f"{tps:.1f} ({ratio})")
        lines.append(f"| {mode} | " + " | ".join(text) + " |")
    return lines
