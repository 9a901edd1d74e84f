"""The chat's banner: the model, what the machine plan picked and why, the heads and their
tree or proposal, the draft, the passes and the decoding mode (``python -m infer.chat`` prints it
on stderr before the first message)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from medusa.chat.prepare import Style, sampling_config, sampling_label
from medusa.models import kinds

if TYPE_CHECKING:
    from medusa.decoding.engine import Engine


def drafting_line(args: argparse.Namespace, engine: Engine, mode: str) -> str:
    """The banner's line for heads that draft per step: what the heads are (they say it), and
    their proposal and where its size came from."""
    from medusa.decoding.tree import tree_key

    heads = engine.heads
    c, key = heads.config, tree_key(engine.device.type, engine.model.dtype)
    proposer = engine.proposer(mode if mode in kinds.kind(c.kind).modes else c.kind)  # lookup, baseline: the heads' own
    device = key if key in heads.dynamic else engine.device.type
    label = f"calibrated for {device}" if device in heads.dynamic else "default"
    label = "sized here" if engine.plan.eagle is not None else label
    return f"heads   {args.heads or 'shipped'} · {heads.describe()} · proposal {label}: {proposer.describe()}"


def banner(args: argparse.Namespace, engine: Engine, mode: str, window: int, style: Style) -> str:
    from medusa.decoding.tree import compile_tree

    lm = engine.model
    params = sum(p.numel() for p in lm.parameters()) / 1e6
    model = args.model or "SmolLM2-135M-Instruct (embedded)"
    lines = [(f"model   {model} · {params:.1f}M parameters · {engine.device} {str(lm.dtype).removeprefix('torch.')} "
             f"· context {window} tokens")]
    # what the machine plan picked and why (dtype, kernels, rows, heads' dtype, trees)
    lines += [line for line in engine.describe() if not line.startswith(("passes", "mode"))]
    facts = None if engine.heads is None else kinds.kind(engine.heads.config.kind)
    if facts is not None and facts.drafts_per_step:
        lines.append(drafting_line(args, engine, mode))
    elif engine.heads is not None:
        source = args.heads or "shipped"
        tree = compile_tree(engine.tree_paths(args.tree))
        device = engine.device.type
        label = args.tree or (f"calibrated for {device}" if engine.heads.trees.get(device) is not None
                              else ("gpu" if device == "cuda" else "cpu"))
        lines.append(f"heads   {source} · {engine.heads.describe()} · tree {label} "
                     f"({tree.num_nodes} nodes, depth {tree.max_depth})")
    if args.draft is not None:
        lines.append(f"draft   {args.draft}")
    if args.compile == "auto" and not engine.passes.compiled:  # the auto pick said no: say why
        lines.append(f"passes  {engine.passes.reason}")
    lines.append(f"mode    {mode} · {sampling_label(sampling_config(args))} · up to {args.max_new_tokens} new tokens")
    if args.show_accepted:
        lines.append("colours " + style.drafted("drafted and accepted") + " · plain: the target's own token")
    return "\n".join(lines)
