"""Acceptance per draft depth of several heads, side by side, at an equal draft budget.

    python scripts/head_acceptance.py --heads medusa --heads eagle --heads eagle3 --heads BLOCK_FOLDER \\
        --prompts runs/prompts/sharegpt-heldout.json --limit 12 --depth 7 [--json OUT]

The target answers the prompts greedily once; then, teacher-forced along those answers, each
heads folder drafts a chain of ``--depth`` top-1 tokens at every position (Medusa heads: head
``k``'s top-1 at depth ``k``, as far as they have heads; eagle and eagle3 heads: their own
draft steps, fed their own predictions, as decoding does; block heads: block position ``d`` of
the one drafter pass's top-1 chain, as far as the block reaches). Reported per depth ``d``: the share
of positions whose first ``d`` drafted tokens are all the target's, so the mean tokens a chain
of ``d`` adds per pass is their sum; and the drafting's milliseconds per position. No tree, no
lookup chain: the heads alone. ``--heads`` takes a folder, a Hub id or a shipped kind
(medusa, eagle, eagle3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from tqdm import tqdm

import medusa
from medusa.autotune.trees import acceptance_by_size, candidate_ranks
from medusa.config import HelpFormatter, count
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.errors import MedusaError
from medusa.models.kinds import kind
from medusa.runtime import hf as kv


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/head_acceptance.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--heads", action="append", required=True,
                    help="heads folder, Hub id or shipped kind (medusa, eagle, eagle3; block heads: a folder or "
                         "Hub id); repeatable")
    ap.add_argument("--model", default=None, help="target (default: the embedded model)")
    from medusa.bench.prompts import DEFAULT_PROMPTS

    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                    help="prompts: a file infer.bench reads, MT-Bench jsonl or ShareGPT json (default: MT-Bench)")
    ap.add_argument("--limit", type=count(1), default=12, help="how many prompts")
    ap.add_argument("--max-new-tokens", type=count(1), default=128, help="the target's answer length")
    ap.add_argument("--depth", type=count(1), default=7, help="tokens each chain drafts")
    ap.add_argument("--json", default=None, help="write the table's numbers to this JSON file (default: none)")
    return ap


def medusa_chain(heads, model, pairs: list[tuple[list[int], list[int]]], depth: int) -> tuple[list[float], float]:
    """Per depth, the share of positions whose heads 1..d all rank the target's token first."""
    depth = min(depth, heads.num_heads)
    hits, total, seconds = torch.zeros(depth), 0, 0.0
    for prompt, answer in pairs:
        seq = torch.tensor(prompt + answer)
        hidden = kv.features(model, seq)[len(prompt) - 1:]
        start = time.perf_counter()
        ranks = candidate_ranks(heads, hidden, seq[len(prompt) - 1:], 1)[:, :depth]  # [n, depth]
        seconds += time.perf_counter() - start
        right = (ranks == 0).long().cumprod(dim=1)  # [n, depth]: the chain is right through depth d
        hits += right.sum(0).float()
        total += ranks.shape[0]
    return (hits / max(total, 1)).tolist(), 1e3 * seconds / max(total, 1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from medusa.bench.prompts import encode, read_prompts

    try:
        base = medusa.load(model=args.model, heads=args.heads[0], autotune=False)
        prompts = [encode(base, p.text) for p in read_prompts(args.prompts, limit=args.limit)]
        with torch.inference_mode():
            answers = [base.generate(p, max_new_tokens=args.max_new_tokens, mode="baseline").tokens
                       for p in tqdm(prompts, desc="target answers", file=sys.stderr)]
        pairs = [(p, a) for p, a in zip(prompts, answers) if len(a) > args.depth + 2]
        rows = []
        for name in args.heads:
            engine = medusa.load(target=base, heads=name, autotune=False)
            heads = engine.heads
            with torch.inference_mode(), engine.kernel_scope():
                facts = kind(heads.config.kind)
                if facts.drafts_per_step:
                    # as deep as asked, or as the heads can draft (a block: its k tokens)
                    depth = min(args.depth, facts.proposer_class().deepest(heads) or args.depth)
                    acc = acceptance_by_size(heads, engine.model, pairs, DynamicTree(nodes=depth, depth=depth, topk=1))
                    # accepted[n - 1]: mean tokens accepted with a chain of n; its increments: right through depth n
                    per_depth = [a - b for a, b in zip(acc.accepted, [0.0] + acc.accepted[:-1])]
                    ms = acc.draft_ms
                else:
                    per_depth, ms = medusa_chain(heads, engine.model, pairs, args.depth)
            rows.append({"heads": name, "kind": heads.config.kind, "per_depth": [round(x, 4) for x in per_depth],
                         "tokens_per_pass": round(1 + sum(per_depth), 3), "draft_ms": round(ms, 2)})
            print(f"{name} ({heads.config.kind}): " + " ".join(f"{x:.3f}" for x in per_depth)
                  + f" -> {1 + sum(per_depth):.2f} tokens per pass, drafting {ms:.1f} ms", file=sys.stderr)
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("| heads | kind | " + " | ".join(f"depth {d}" for d in range(1, args.depth + 1))
          + " | tokens per pass (chain) | drafting ms |")
    print("|---|---|" + "---|" * args.depth + "---|---|")
    for r in rows:
        cells = [f"{x:.3f}" for x in r["per_depth"]] + ["-"] * (args.depth - len(r["per_depth"]))
        print(f"| {r['heads']} | {r['kind']} | " + " | ".join(cells) + f" | {r['tokens_per_pass']:.2f} | {r['draft_ms']:.1f} |")
    if args.json:
        meta = {"prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens, "depth": args.depth,
                "positions_from": len(pairs), "threads": torch.get_num_threads()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
