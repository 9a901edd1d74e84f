"""Calibrate the decode tree (and the draft vocabulary) of a set of heads for this device.

Medusa heads get a static tree; eagle heads get the size of their per-step dynamic tree
(nodes verified, depth, top-k), from the same answers and the same pass-cost curve.

    python scripts/calibrate_tree.py --heads HEADS_DIR [--model M] [--prompts sharegpt] [--samples 48]

1. The target answers held-out prompts greedily: the text the tree will be verified on.
2. The draft vocabulary: the most frequent tokens of those answers and of reference
   answers from the data (greedy top-k then scores only these).
3. Per-path acceptance of the heads on the target's own answers (teacher-forced).
4. The target's pass cost T(n) for n new tokens on this device.
5. The tree with the most expected tokens per second; written with everything measured
   to HEADS_DIR/calibration.json, which medusa.load picks up (the tree for this device
   type, the draft vocabulary).

``--long-prompts FILE``: eagle and block heads' acceptance on long prompts per context length too,
which the plan sizes their trees at long contexts from (medusa/autotune/sizing.py ``by_length``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import medusa
from medusa.autotune.calibration import (
    curves_by_length,
    draft_vocab,
    eagle_curves,
    greedy_answers,
    head_accuracy,
    head_ranks,
    held_out_prompts,
    parse_cost,
    pass_cost,
    read_calibration,
    write_calibration,
)
from medusa.autotune.drawn import calibrate_drawn
from medusa.autotune.trees import choose_dynamic, choose_tree, path_counts
from medusa.bench.prompts import encode, read_prompts
from medusa.config import HelpFormatter, count, temperatures_arg
from medusa.decoding.tree import tree_key
from medusa.errors import MedusaError
from medusa.models.heads_config import CALIBRATION_NAME
from medusa.models.kinds import kind
from medusa.models.target import set_chat_template
from medusa.runtime.kernels import kernels_arg

DEFAULT_EXCLUDE = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "data" / "selfdistill").glob("*.jsonl.gz"))


def measured_cost(args: argparse.Namespace, engine, prompts: list[list[int]], max_n: int) -> dict[int, float]:
    if args.cost:
        return parse_cost(args.cost)
    return pass_cost(engine, prompts, max_n, args.max_new_tokens, args.compile)


def command(argv: list[str] | None) -> str:
    """The command line that made an entry (each device/dtype entry keeps its own)."""
    return "python scripts/calibrate_tree.py " + " ".join(argv if argv is not None else sys.argv[1:])


def calibrate_eagle(args: argparse.Namespace, argv: list[str] | None, engine, prompts: list[list[int]],
                    answers: list[list[int]], vocab_ids: list[int] | None, coverage: float) -> int:
    """Eagle heads: acceptance of the N best nodes of dynamic trees (teacher-forced on the
    target's answers) against the pass cost; the best size goes to calibration.json."""
    pairs = [(p, a) for p, a in zip(prompts, answers) if a]
    curves = eagle_curves(engine, pairs, args.max_nodes, args.max_chain)
    cost = measured_cost(args, engine, prompts, args.max_nodes + 1 + args.max_chain)
    size, expected, tps = choose_dynamic(curves, cost, max_rows=engine.max_rows)
    hybrid, hybrid_expected, hybrid_tps = choose_dynamic(curves, cost, hybrid=True, max_rows=engine.max_rows)
    # kept per device and dtype, as the Medusa trees below (the engine reads its dtype's first)
    device = tree_key(args.for_device or engine.device.type, engine.model.dtype)
    for (depth, topk), acc in curves.items():
        print(f"depth {depth} top-{topk}: drafting {acc.draft_ms:.1f} ms/step; accepted drafts with N nodes: "
              + ", ".join(f"{n}:{a:.2f}" for n, a in enumerate(acc.accepted, start=1) if n in (1, 2, 4, 8, 16, 32, 64)))
    print("T(n) ms: " + ", ".join(f"{n}:{ms:.1f}" for n, ms in cost.items()))
    print(f"best on {device}: {size.nodes} nodes (depth {size.depth}, top-{size.topk}), expected {expected:.2f} "
          f"tokens/pass -> {tps:.1f} tokens/s (plain decoding: {1e3 / cost[1]:.1f} tokens/s)")
    print(f"best hybrid on {device}: {hybrid.nodes} nodes (depth {hybrid.depth}, top-{hybrid.topk}) and a "
          f"{hybrid.chain}-token lookup chain, expected {hybrid_expected:.2f} tokens/pass -> {hybrid_tps:.1f} tokens/s")
    drawn = calibrate_drawn(engine, prompts, args.temperatures, args.max_new_tokens, args.seed, args.max_chain,
                                    args.siblings)
    by_context = long_curves(args, engine)
    if args.dry_run:
        return 0
    path = Path(args.heads) / CALIBRATION_NAME
    record = read_calibration(path)
    record.setdefault("dynamic", {})[device] = {**size.as_dict(), "hybrid": hybrid.as_dict()}
    del record["dynamic"][device]["chain"]
    record.setdefault("measured", {})[device] = {
        "expected_tokens_per_pass": expected, "tokens_per_second": tps, "cost_ms": {str(k): v for k, v in cost.items()},
        "cost_measured": not args.cost, "kernels": engine.kernels, "threads": torch.get_num_threads(),
        "accuracy_measured_on": engine.device.type,
        "curves": {f"{d}x{k}": acc.as_record() for (d, k), acc in curves.items()},
        "command": command(argv),
    }
    if drawn:
        record["measured"][device]["drawn"] = drawn
    if by_context:
        record["measured"][device]["curves_by_context"] = by_context
    record["draft_vocab_coverage"] = coverage
    record["draft_vocab"] = vocab_ids
    record["command"] = command(argv)
    write_calibration(path, record)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/calibrate_tree.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--heads", required=True, help="heads folder to calibrate (calibration.json is written into it)")
    ap.add_argument("--model", default=None, help="target (default: the embedded model)")
    ap.add_argument("--prompts", default="sharegpt", help="conversation source for held-out prompts (sharegpt, .json/.jsonl, Hub id)")
    ap.add_argument("--seed", type=int, default=4321,
                    help="shuffle seed picking the held-out prompts (not scripts/heldout_prompts.py's 1234: the benchmark's prompts stay unseen)")
    ap.add_argument("--exclude", nargs="*", default=DEFAULT_EXCLUDE,
                    help="answer files (.jsonl or .jsonl.gz with id and messages) whose prompts are not held-out "
                         "prompts (default: data/selfdistill/*.jsonl.gz, the heads' training data)")
    ap.add_argument("--samples", type=count(1), default=48, help="how many prompts the target answers")
    ap.add_argument("--max-new-tokens", type=count(1), default=128, help="longest answer in tokens")
    ap.add_argument("--max-prompt-tokens", type=count(1), default=256, help="longer prompts are skipped")
    ap.add_argument("--chat-template", default=None,
                    help="Jinja chat template (file or text) the heads' data was generated with, for a tokenizer "
                         "that has none, e.g. configs/chat_templates/question_answer.jinja for Gemma 3 270M (default: "
                         "the tokenizer's own)")
    ap.add_argument("--vocab-size", type=count(0), default=8192, help="draft vocabulary size (0: score the full vocabulary)")
    ap.add_argument("--reference-answers", type=count(0), default=2000, help="reference answers counted for the draft vocabulary")
    ap.add_argument("--max-nodes", type=count(1), default=64, help="largest tree considered (candidates, root excluded)")
    ap.add_argument("--max-chain", type=count(1), default=16,
                    help="eagle heads: the longest lookup chain mode hybrid is sized with (chains of 0 to this "
                         "many tokens are tried)")
    ap.add_argument("--max-rank", type=count(1), default=10, help="deepest rank of a head's top-k considered")
    ap.add_argument("--cost", default=None,
                    help="use this pass-cost curve instead of measuring it, as 'n:ms,n:ms,...', e.g. measured earlier on an idle "
                         "machine (default: measured now)")
    ap.add_argument("--compile", action="store_true",
                    help="measure the pass cost as an engine with compile=True runs it (static cache, torch.compile)")
    ap.add_argument("--for-device", default=None,
                    help="store the tree for this device type (e.g. cuda) instead of this machine's: head accuracy is "
                         "measured here, the cost curve must come from --cost measured on that device (default: "
                         "this machine's)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps ... (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as medusa.load picks on this device)")
    ap.add_argument("--kernels", type=kernels_arg, default=None,
                    help="the engine's linear kernels (default: the faster on this device, as medusa.load picks)")
    ap.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8"), default=None,
                    help="the heads' dtype while drafting (default: as medusa.load picks on this device; "
                         "int8: eagle heads on int8 weights, CPU)")
    ap.add_argument("--temperatures", type=temperatures_arg, default=[0.7, 1.0],
                    help="temperatures the heads' drawn chains are calibrated at, on answers the target "
                         "samples at each ('none': skip; default: 0.7,1.0)")
    ap.add_argument("--siblings", type=count(1), default=1, help="also calibrate drawn levels of up to this many "
                    "siblings a depth, for the plan to choose trees or chains (default: 1, chains only)")
    ap.add_argument("--drawn-only", action="store_true", help="add the drawn chains' calibration to this device's "
                    "existing entry, keeping everything else (the draft vocabulary, the trees)")
    ap.add_argument("--long-prompts", default=None,
                    help="eagle and block heads: also measure their acceptance on these long prompts (MT-Bench jsonl, "
                         "e.g. written by scripts/long_prompts.py with a seed of its own), per context length, "
                         "for the sizes at long contexts (default: none)")
    ap.add_argument("--long-only", action="store_true",
                    help="add only the --long-prompts acceptance to this device's existing entry, keeping the rest")
    ap.add_argument("--dry-run", action="store_true", help="print the result without writing calibration.json")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.for_device and not args.cost:
        print("error: --for-device needs --cost, the pass-cost curve measured on that device", file=sys.stderr)
        return 1
    try:
        engine = medusa.load(model=args.model, heads=args.heads, device=args.device, dtype=args.dtype,
                             kernels=args.kernels, draft_dtype=args.draft_dtype)
        heads = engine.heads
        set_chat_template(engine.tokenizer, args.chat_template)
        if not getattr(engine.tokenizer, "chat_template", None):
            raise MedusaError(f"{args.model} has no chat template: pass --chat-template FILE, the template its heads' "
                              "data was generated with (e.g. configs/chat_templates/question_answer.jinja)")
        prompts, reference = held_out_prompts(engine.tokenizer, args.prompts, args.samples, args.exclude, args.seed,
                                              args.max_prompt_tokens, args.reference_answers)
        if args.drawn_only:
            return add_drawn(args, argv, engine, prompts)
        if args.long_only:
            return add_long(args, argv, engine)
        heads.set_draft_vocab(None)
        answers = greedy_answers(engine, prompts, args.max_new_tokens)
        vocab_ids, coverage = draft_vocab(engine, answers, reference, args.vocab_size)
        if kind(heads.config.kind).drafts_per_step:  # block heads: sized as a DynamicTree too
            return calibrate_eagle(args, argv, engine, prompts, answers, vocab_ids, coverage)
        ranks = head_ranks(engine, prompts, answers, args.max_rank)
        counts_paths = path_counts(ranks)
        positions = ranks.shape[0]
        accuracy = head_accuracy(ranks, heads.num_heads)

        cost = measured_cost(args, engine, prompts, args.max_nodes + 1)
        choice = choose_tree(counts_paths, positions, cost, args.max_nodes)
        drawn = calibrate_drawn(engine, prompts, args.temperatures, args.max_new_tokens, args.seed, args.max_chain,
                                    args.siblings)
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    # trees and cost curves are kept per device and dtype ("cpu", "cpu-bfloat16", "cuda-bfloat16")
    device = tree_key(args.for_device or engine.device.type, engine.model.dtype)
    print(f"positions {positions}, draft vocabulary {len(vocab_ids) if vocab_ids else 'full'} (covers {coverage:.1%} of held-out answer tokens)")
    for name, acc in accuracy.items():
        print(f"  {name}: top-1 {acc['top1']:.3f}  top-5 {acc['top5']:.3f}")
    print("T(n) ms: " + ", ".join(f"{n}:{ms:.1f}" for n, ms in cost.items()))
    print(f"best tree on {device}: {len(choice.paths)} candidates, expected {choice.expected_tokens:.2f} tokens/pass, "
          f"{choice.step_ms:.1f} ms/pass -> {choice.tokens_per_second:.1f} tokens/s "
          f"(plain decoding: {1e3 / cost[1]:.1f} tokens/s)")
    if not args.dry_run:
        write_record(args, argv, engine, device, choice, cost, positions, accuracy, vocab_ids, coverage, drawn)
    return 0


def add_drawn(args, argv, engine, prompts: list[list[int]]) -> int:
    """``--drawn-only``: the drawn chains' curves into this device's calibrated entry."""
    if not hasattr(kind(engine.heads.config.kind).proposer_class(), "chain_laws") or not args.temperatures:
        raise MedusaError("--drawn-only calibrates heads' drawn chains: pass heads that draw them and --temperatures")
    return add_to_entry(args, argv, engine, "--drawn-only", lambda: {"drawn": calibrate_drawn(
        engine, prompts, args.temperatures, args.max_new_tokens, args.seed, args.max_chain, args.siblings),
        "drawn_command": command(argv)})


def long_curves(args, engine) -> dict[str, dict]:
    """``--long-prompts``: the acceptance curves on the long prompts, per context length."""
    if not args.long_prompts:
        return {}
    prompts = [encode(engine, prompt.text) for prompt in read_prompts(args.long_prompts)]
    return curves_by_length(engine, prompts, args.max_new_tokens, args.max_nodes, args.max_chain)


def add_long(args, argv, engine) -> int:
    """``--long-only``: the long prompts' curves into this device's calibrated entry."""
    if not kind(engine.heads.config.kind).drafts_per_step or not args.long_prompts:
        raise MedusaError("--long-only calibrates eagle or block heads at long contexts: pass them and --long-prompts")
    return add_to_entry(args, argv, engine, "--long-only", lambda: {"curves_by_context": long_curves(args, engine),
                                                                   "long_command": command(argv)})


def add_to_entry(args, argv, engine, flag: str, measure) -> int:
    """The fields ``measure()`` returns, into this device's existing calibrated entry."""
    device = tree_key(args.for_device or engine.device.type, engine.model.dtype)
    path = Path(args.heads) / CALIBRATION_NAME
    if not isinstance(read_calibration(path).get("measured", {}).get(device), dict):
        raise MedusaError(f"{path} has no entry for {device}: calibrate these heads without {flag} first")
    fields = measure()
    if args.dry_run:
        return 0
    record = read_calibration(path)
    record["measured"][device].update(fields)
    write_calibration(path, record)
    print(f"wrote {path}")
    return 0


def write_record(args, argv, engine, device, choice, cost, positions, accuracy, vocab_ids, coverage, drawn) -> None:
    """The tree and what it was chosen from, into the heads folder's calibration.json."""
    path = Path(args.heads) / CALIBRATION_NAME
    record = read_calibration(path)
    record.setdefault("trees", {})[device] = [list(p) for p in choice.paths]
    record.setdefault("measured", {})[device] = {
        "positions": positions, "expected_tokens_per_pass": choice.expected_tokens, "step_ms": choice.step_ms,
        "cost_ms": {str(k): v for k, v in cost.items()}, "cost_measured": not args.cost, "compiled": args.compile,
        "kernels": engine.kernels, "threads": torch.get_num_threads(), "accuracy_measured_on": engine.device.type,
        "curve": [list(c) for c in choice.curve],
        "command": command(argv),
    }
    if drawn:
        record["measured"][device]["drawn"] = drawn
    record["accuracy"] = accuracy
    record["draft_vocab_coverage"] = coverage
    record["draft_vocab"] = vocab_ids
    record["command"] = command(argv)
    write_calibration(path, record)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
