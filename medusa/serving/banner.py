"""The chat's banner: the model, what the machine plan picked and why, the heads and their
tree or proposal, the draft, the passes and the decoding mode (``python -m infer.chat`` prints it
on stderr before the first message)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from medusa.models import kinds
from medusa.serving.chat_setup import Style, sampling_config, sampling_label

if TYPE_CHECKING:
    from medusa.decoding.engine import Engine


def block_line(args: argparse.Namespace, engine: Engine, mode: str) -> str:
    """The banner's line for block heads: the block, its layers and vocabulary, the proposal."""
    c = engine.heads.config
    facts = kinds.kind(c.kind)
    proposer = engine.proposer(mode if mode in facts.modes else c.kind)  # lookup, baseline: the heads' own
    label = "sized here" if engine.plan.eagle is not None else "default"
    return (f"heads   {args.heads} · block of {c.num_heads} tokens per drafter pass (layers "
            f"{', '.join(map(str, c.feature_layers))}, {c.draft_vocab_size:,}-token draft vocabulary) · "
            f"proposal {label}: {proposer.describe()}")


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
    if facts is not None and facts.dynamic_tree:
        from medusa.decoding.tree import tree_key

        c, key = engine.heads.config, tree_key(engine.device.type, engine.model.dtype)
        proposer = engine.proposer(mode if mode in facts.modes else c.kind)  # lookup, baseline: the heads' own
        device = key if key in engine.heads.dynamic else engine.device.type
        label = f"calibrated for {device}" if device in engine.heads.dynamic else "default"
        label = "sized here" if engine.plan.eagle is not None else label
        kind = (f"eagle3 (layers {', '.join(map(str, c.feature_layers))}, {c.draft_vocab_size:,}-token draft vocabulary)"
                if facts.fused else f"eagle ({c.eagle_layout})")
        lines.append(f"heads   {args.heads or 'shipped'} · {kind}, {c.num_heads} draft steps trained · "
                     f"proposal {label}: {proposer.describe()}")
    elif facts is not None and facts.drafts_per_step:
        lines.append(block_line(args, engine, mode))
    elif engine.heads is not None:
        c = engine.heads.config
        source = args.heads or "shipped"
        tree = compile_tree(engine.tree_paths(args.tree))
        device = engine.device.type
        label = args.tree or (f"calibrated for {device}" if engine.heads.trees.get(device) is not None
                              else ("gpu" if device == "cuda" else "cpu"))
        lines.append(f"heads   {source} · {c.num_heads} heads x {c.num_layers} layer(s) · tree {label} "
                     f"({tree.num_nodes} nodes, depth {tree.max_depth})")
    if args.draft is not None:
        lines.append(f"draft   {args.draft}")
    if args.compile == "auto" and not engine.passes.compiled:  # the auto pick said no: say why
        lines.append(f"passes  {engine.passes.reason}")
    lines.append(f"mode    {mode} · {sampling_label(sampling_config(args))} · up to {args.max_new_tokens} new tokens")
    if args.show_accepted:
        lines.append("colours " + style.drafted("drafted and accepted") + " · plain: the target's own token")
    return "\n".join(lines)
