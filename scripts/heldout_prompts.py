"""Prompts the shipped heads never trained on, for a benchmark outside MT-Bench.

    python scripts/heldout_prompts.py --output runs/prompts/sharegpt-heldout.json --samples 40
    python -m infer.bench --prompts runs/prompts/sharegpt-heldout.json --modes hf,lookup,hybrid@eagle

Reads a conversation source (default: ShareGPT, the source of the self-distilled training
answers), drops every conversation whose first user turn is the prompt of an answer in the
training files (``--exclude``, by id and by text: ShareGPT repeats prompts under other ids),
keeps first turns of a readable length, and writes N of them, picked with a seed, as ShareGPT
JSON (``id``, ``conversations``), the format ``infer.bench --prompts`` reads. ``--wrap`` writes
each prompt inside a text template, for a base model without a chat template (the bench then
tokenises the text as it is):

    python scripts/heldout_prompts.py --output runs/prompts/gemma-heldout-qa.json --samples 24 \
        --max-chars 800 --wrap 'Question: {prompt}\nAnswer:'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from medusa.config import HelpFormatter, count, writable_folder
from medusa.errors import MedusaError
from medusa.training.sources import SHAREGPT, DataStats, answered_prompts, load_conversations, prompt_key

DEFAULT_EXCLUDE = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "data" / "selfdistill").glob("*.jsonl.gz"))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/heldout_prompts.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--output", help="ShareGPT-format JSON file to write (required)")
    ap.add_argument("--samples", type=count(1), default=40, help="how many prompts")
    ap.add_argument("--prompts", default=SHAREGPT, help="conversation source: 'sharegpt', a .json/.jsonl file or a Hub id")
    for old, new in (("--out", "output"), ("--n", "samples"), ("--source", "prompts")):  # the old spellings
        ap.add_argument(old, dest=new, type=count(1) if new == "samples" else None, help=argparse.SUPPRESS)
    ap.add_argument("--exclude", nargs="*", default=DEFAULT_EXCLUDE,
                    help="training files (.jsonl or .jsonl.gz with id and messages) whose prompts are left out "
                         "(default: data/selfdistill/*.jsonl.gz)")
    ap.add_argument("--seed", type=int, default=1234, help="shuffle seed picking the prompts")
    ap.add_argument("--min-chars", type=count(0), default=16, help="shortest first turn kept")
    ap.add_argument("--max-chars", type=count(0), default=1500, help="longest first turn kept")
    ap.add_argument("--wrap", default=None, help="write each prompt as this text with {prompt} replaced "
                                                 "(\\n is a newline), e.g. 'Question: {prompt}\\nAnswer:' (default: the prompt as it is)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.output is None:  # not required=True: the old spelling --out also sets it
        ap.error("the following arguments are required: --output")
    if not 0 <= args.min_chars <= args.max_chars:
        ap.error("need 0 <= --min-chars <= --max-chars")
    if args.wrap is not None:
        if args.wrap.count("{prompt}") != 1:
            ap.error(f"--wrap {args.wrap!r} must hold {{prompt}} once, e.g. 'Question: {{prompt}}\\nAnswer:'")
        args.wrap = args.wrap.replace("\\n", "\n")
    return args


def pick(source: str, exclude: list[str], n: int, seed: int, min_chars: int, max_chars: int,
         wrap: str | None = None) -> list[dict]:
    ids, texts = answered_prompts(exclude)
    picked: list[dict] = []
    seen: set[str] = set()
    for cid, messages in load_conversations(source, DataStats(), seed=seed):
        first = next(m["content"] for m in messages if m["role"] == "user")
        key = prompt_key(first)
        if cid.split(":", 1)[-1] in ids or key in texts or key in seen or not min_chars <= len(key) <= max_chars:
            continue
        seen.add(key)
        text = first if wrap is None else wrap.replace("{prompt}", first)
        picked.append({"id": cid, "conversations": [{"from": "human", "value": text}]})
        if len(picked) == n:
            break
    if len(picked) < n:
        raise MedusaError(f"only {len(picked)} prompts of {source} are outside the training files and "
                          f"{min_chars}-{max_chars} characters long: lower --samples or widen the limits")
    return picked


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.output)
    writable_folder(out.parent, "--output")
    prompts = pick(args.prompts, args.exclude, args.samples, args.seed, args.min_chars, args.max_chars, args.wrap)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(prompts, ensure_ascii=False, indent=1))
    os.replace(tmp, out)
    print(f"wrote {len(prompts)} prompts outside {len(args.exclude)} training file(s) to {out}")


if __name__ == "__main__":
    try:
        main()
    except MedusaError as err:
        sys.exit(f"error: {err}")
