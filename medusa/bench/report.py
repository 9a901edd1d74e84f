"""What a bench run writes: its meta (what the results were measured with), the --json file, and
the --output folder (results.json, table.md and plots)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path

import torch

from medusa.bench.engines import drafts, eagle_engine, engine_for, lookahead_reason, sizes_reason, static_tree
from medusa.bench.modes import mode_spec, runs_lookahead
from medusa.bench.prompts import Prompt
from medusa.bench.records import Bench
from medusa.bench.summary import profile_lines, table
from medusa.decoding.engine import Engine
from medusa.models.heads import MedusaHeads


def run_meta(bench: Bench, prompts: list[Prompt], modes: list[str], fastest: str | None) -> dict:
    """What the results were measured with (the engines' plans from ``engine.describe()``)."""
    a, engine, eagle = bench.args, bench.main, eagle_engine(bench)
    compiled = next((e for (_, on, _, _), e in bench.engines.items() if on), None)
    return {"model": a.model or "embedded default", "heads": a.heads or "default", "max_new_tokens": a.max_new_tokens,
            "draft": None if engine.draft is None else (a.draft or "default"), "draft_tokens": a.draft_tokens,
            "adaptive_draft": a.adaptive_draft, "draft_confidence": a.draft_confidence,
            "lookup_tokens": a.lookup_tokens, "match_chains": getattr(a, "match_chains", True),
            "lookup_ngram": a.lookup_ngram,
            "answer_ngrams": _answer_ngrams(eagle or engine, a.answer_ngrams),
            "prompts": a.prompts, "num_prompts": len(prompts), "device": str(engine.device),
            "dtype": str(engine.model.dtype), "torch_threads": torch.get_num_threads(), "kernels": engine.kernels,
            "plan": engine.describe(), "eagle_plan": None if eagle is None or eagle is engine else eagle.describe(),
            "sampling": dataclasses.asdict(bench.sampling), "default_mode": engine.default_mode,
            "tree_nodes": _tree_nodes(engine, bench.tree), "compile_seconds": bench.compile_seconds,
            "eagle_tree_nodes": _tree_nodes(eagle, None) if eagle is not None and eagle is not engine else None,
            "tree_sizes": sizes_reason(eagle or engine),
            "compiled_tree_sizes": sizes_reason(compiled) if compiled is not None else None,
            "lookahead": lookahead_reason(engine) if runs_lookahead(modes) else None,
            "kernel_plans": {k[3]: e.describe() for k, e in bench.engines.items() if k[3] is not None} or None,
            "proposals": _proposals(bench, modes), "fastest_transformers": fastest}


def _proposals(bench: Bench, modes: list[str]) -> dict[str, str]:
    """Each engine mode's proposal, in its proposer's words (Proposer.describe)."""
    out = {}
    for name in modes:
        spec = mode_spec(name)
        if spec is not None:
            engine = engine_for(bench, spec)
            out[name] = engine.proposer(spec.base, static_tree(engine, bench.tree)).describe()
    return out


def _tree_nodes(engine: Engine, tree: str | None) -> int | None:
    """Nodes (root included) of the heads' tree: the static tree of Medusa heads, the dynamic
    tree's budget of eagle heads, the block heads' proposal (chain and siblings)."""
    if engine.heads is None:
        return None
    if drafts(engine):
        return engine.proposer(engine.heads.config.kind).max_rows
    return len(engine.tree_paths(tree)) + 1


def _answer_ngrams(engine: Engine, wanted: bool) -> str | None:
    """What the hybrid modes' chains draw on besides the text: the heads' n-gram table, if used."""
    table = getattr(engine.heads, "ngrams", None)
    if table is None or not wanted:
        return None
    return f"{len(table)} contexts from {table.sequences} answers"


def write_results(args: argparse.Namespace, meta: dict, summary: dict, reference: str | None, heads) -> Path | None:
    """The --json file and the --output folder, those asked for; the folder written, if any."""
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "modes": summary}, indent=1))
    if not args.output:
        return None
    return write_report(Path(args.output), meta, summary, reference,
                        "\n\n".join([table(summary, reference), *profile_lines(summary)]), heads)


def write_temperatures(args: argparse.Namespace, meta: dict, summaries: dict[float, dict]) -> None:
    """The --json file of a run at several temperatures: every temperature's summary."""
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "temperatures": {f"{t:g}": s for t, s in summaries.items()}},
                                   indent=1))


def category_table(summary: dict, reference: str | None) -> str:
    """Tokens/s per category and mode, with the speedup over the reference mode."""
    modes = list(summary)
    cats = sorted({c for s in summary.values() for c in s["categories"]})
    lines = ["| category | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for c in cats:
        ref = summary[reference]["categories"].get(c, {}).get("tokens_per_second") if reference in summary else None
        cells = []
        for m in modes:
            tps = summary[m]["categories"].get(c, {}).get("tokens_per_second", 0.0)
            cells.append(f"{tps:.1f}" + (f" ({tps / ref:.2f}x)" if ref and m != reference else ""))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def head_accuracy(heads: MedusaHeads | None) -> dict[str, dict[str, float]] | None:
    """Per-head held-out accuracy recorded with the heads (training eval), if any."""
    if heads is None:
        return None
    extra = heads.config.extra or {}
    acc = extra.get("eval_accuracy") or extra.get("accuracy")
    return acc if isinstance(acc, dict) and acc else None


def write_report(folder: Path, meta: dict, summary: dict, reference: str | None, main_table: str,
                 heads: MedusaHeads | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"meta": meta, "modes": summary}, indent=1))
    md = [f"Model: {meta['model']}; heads: {meta['heads']}; {meta['num_prompts']} prompts; "
          f"{meta['max_new_tokens']} new tokens; {meta['device']} {meta['dtype']}, {meta['torch_threads']} threads.", "",
          main_table, "", "Tokens/s per category (speedup vs reference):", "", category_table(summary, reference), ""]
    (folder / "table.md").write_text("\n".join(md))

    modes = list(summary)
    _speed_plot(plt, folder, summary, reference, modes)
    _accepted_plot(plt, folder, summary, modes)
    _category_plot(plt, folder, summary, reference, modes)
    _accuracy_plot(plt, folder, heads)
    return folder


def _speed_plot(plt, folder: Path, summary: dict, reference: str | None, modes: list[str]) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    tps = [summary[m]["tokens_per_second"] for m in modes]
    axes[0].bar(modes, tps, color="tab:blue")
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("throughput")
    speed = [summary[m]["speedup"] or 0.0 for m in modes]
    axes[1].bar(modes, speed, color="tab:green")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_ylabel(f"speedup vs {reference}")
    axes[1].set_title("speedup")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(folder / "speed.png", dpi=120)
    plt.close(fig)


def _accepted_plot(plt, folder: Path, summary: dict, modes: list[str]) -> None:
    spec = [m for m in modes if any(p.get("accepted") for p in summary[m]["per_prompt"])]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        width = 0.8 / len(spec)
        for i, m in enumerate(spec):
            hist = Counter(a for p in summary[m]["per_prompt"] for a in (p.get("accepted") or []))
            total = sum(hist.values())
            xs = sorted(hist)
            ax.bar([x + i * width for x in xs], [hist[x] / total for x in xs], width=width, label=m)
        ax.set_xlabel("tokens emitted per target pass")
        ax.set_ylabel("fraction of steps")
        ax.set_title("accepted length")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "accepted_length.png", dpi=120)
        plt.close(fig)


def _category_plot(plt, folder: Path, summary: dict, reference: str | None, modes: list[str]) -> None:
    cats = sorted({c for s in summary.values() for c in s["categories"]})
    if reference in summary and len(cats) > 1:
        fig, ax = plt.subplots(figsize=(8, 3.8))
        others = [m for m in modes if m != reference]
        width = 0.8 / max(len(others), 1)
        for i, m in enumerate(others):
            vals = []
            for c in cats:
                ref = summary[reference]["categories"].get(c, {}).get("tokens_per_second") or 0.0
                vals.append(summary[m]["categories"].get(c, {}).get("tokens_per_second", 0.0) / ref if ref else 0.0)
            ax.bar([x + i * width for x in range(len(cats))], vals, width=width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cats))], cats, rotation=30)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel(f"speedup vs {reference}")
        ax.set_title("speedup per category")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "speedup_by_category.png", dpi=120)
        plt.close(fig)


def _accuracy_plot(plt, folder: Path, heads) -> None:
    acc = head_accuracy(heads)
    if acc:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        names = list(acc)
        for key in sorted({k for v in acc.values() for k in v}):
            ax.plot(names, [acc[n].get(key, float("nan")) for n in names], marker="o", label=key)
        ax.set_ylabel("held-out accuracy")
        ax.set_title("per-head accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "head_accuracy.png", dpi=120)
        plt.close(fig)
