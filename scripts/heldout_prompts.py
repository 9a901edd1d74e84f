"""Prompts the shipped heads never trained on, for a benchmark outside MT-Bench.

    python scripts/heldout_prompts.py --out runs/prompts/sharegpt-heldout.json --n 40
    python -m infer.bench --prompts runs/prompts/sharegpt-heldout.json --modes hf,lookup,hybrid@eagle

Reads a conversation source (default: ShareGPT, the source of the self-distilled training
answers), drops every conversation whose first user turn is the prompt of an answer in the
training files (``--exclude``, by id and by text: ShareGPT repeats prompts under other ids),
keeps first turns of a readable length, and writes N of them, picked with a seed, as ShareGPT
JSON (``id``, ``conversations``), the format ``infer.bench --prompts`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from medusa.config import count, writable_folder
from medusa.errors import MedusaError
from medusa.training.sources import SHAREGPT, DataStats, answered_prompts, load_conversations, prompt_key

DEFAULT_EXCLUDE = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "data" / "selfdistill").glob("*.jsonl.gz"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python scripts/heldout_prompts.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="ShareGPT-format JSON file to write")
    ap.add_argument("--n", type=count(1), default=40, help="how many prompts")
    ap.add_argument("--source", default=SHAREGPT, help="conversation source: 'sharegpt', a .json/.jsonl file or a Hub id")
    ap.add_argument("--exclude", nargs="*", default=DEFAULT_EXCLUDE,
                    help="training files (.jsonl or .jsonl.gz with id and messages) whose prompts are left out "
                         "(default: data/selfdistill/*.jsonl.gz)")
    ap.add_argument("--seed", type=int, default=1234, help="shuffle seed picking the prompts")
    ap.add_argument("--min-chars", type=count(0), default=16, help="shortest first turn kept")
    ap.add_argument("--max-chars", type=count(0), default=1500, help="longest first turn kept")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be at least 1")
    if not 0 <= args.min_chars <= args.max_chars:
        ap.error("need 0 <= --min-chars <= --max-chars")
    return args


def pick(source: str, exclude: list[str], n: int, seed: int, min_chars: int, max_chars: int) -> list[dict]:
    ids, texts = answered_prompts(exclude)
    picked: list[dict] = []
    seen: set[str] = set()
    for cid, messages in load_conversations(source, DataStats(), seed=seed):
        first = next(m["content"] for m in messages if m["role"] == "user")
        key = prompt_key(first)
        if cid.split(":", 1)[-1] in ids or key in texts or key in seen or not min_chars <= len(key) <= max_chars:
            continue
        seen.add(key)
        picked.append({"id": cid, "conversations": [{"from": "human", "value": first}]})
        if len(picked) == n:
            break
    if len(picked) < n:
        raise MedusaError(f"only {len(picked)} prompts of {source} are outside the training files and "
                          f"{min_chars}-{max_chars} characters long: lower --n or widen the limits")
    return picked


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    writable_folder(out.parent, "--out")
    prompts = pick(args.source, args.exclude, args.n, args.seed, args.min_chars, args.max_chars)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(prompts, ensure_ascii=False, indent=1))
    os.replace(tmp, out)
    print(f"wrote {len(prompts)} prompts outside {len(args.exclude)} training file(s) to {out}")


if __name__ == "__main__":
    try:
        main()
    except MedusaError as err:
        sys.exit(f"error: {err}")
