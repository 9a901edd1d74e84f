"""Build a heads folder's n-gram table of the target's answers (``ngrams.safetensors``).

    python scripts/build_ngrams.py --heads medusa/assets/heads/smollm2-135m-instruct-eagle

Mode ``hybrid`` drafts its lookup chain from this table where the prompt and the answer so far
have no match (medusa/runtime/ngrams.py). The answers are the target's own (its self-distilled
training data; by default the embedded model's, ``data/selfdistill/smollm2-135m-instruct*.jsonl.gz``;
another target needs ``--data``), tokenized as training tokenizes them;
each answer is kept with the ``max_n - 1`` template tokens before it, so the table also knows
how answers begin. Prompts the table should be measured on must not be among them
(``scripts/heldout_prompts.py`` picks prompts outside the same files).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from medusa.config import HelpFormatter, count
from medusa.errors import MedusaError
from medusa.models.heads_config import read_heads_config
from medusa.models.target import load_tokenizer, set_chat_template
from medusa.runtime.ngrams import NGRAMS_NAME, NgramTable
from medusa.training.data import tokenize_conversation
from medusa.training.sources import DataStats, load_conversations

# the embedded model's own answers (data/selfdistill holds other targets' answers too)
DEFAULT_DATA = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "data" / "selfdistill")
                      .glob("smollm2-135m-instruct*.jsonl.gz"))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/build_ngrams.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--heads", required=True, help="heads folder to write ngrams.safetensors into")
    ap.add_argument("--data", nargs="+", default=None,
                    help="the target's answers: .jsonl(.gz) files with messages (default, for the embedded model "
                         "only: data/selfdistill/smollm2-135m-instruct*.jsonl.gz)")
    ap.add_argument("--model", default=None, help="the target whose tokenizer is used (default: the embedded model)")
    ap.add_argument("--chat-template", default=None,
                    help="Jinja chat template (file or text) the answers were generated with, for a tokenizer "
                         "that has none, e.g. configs/chat_templates/question_answer.jinja for Gemma 3 270M (default: the "
                         "tokenizer's own)")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code to run")
    ap.add_argument("--max-n", type=count(1), default=4, help="longest context, in tokens")
    ap.add_argument("--min-n", type=count(1), default=2, help="shortest context, in tokens")
    ap.add_argument("--min-count", type=count(1), default=2, help="times a continuation must have been seen")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not 1 <= args.min_n <= args.max_n:
        ap.error("need 1 <= --min-n <= --max-n")
    if args.data is None:
        if args.model is not None:
            ap.error("--model needs --data: that target's own answers (the default ones are the embedded model's)")
        args.data = DEFAULT_DATA
    return args


def answer_sequences(tokenizer, files: list[str], context: int) -> list[list[int]]:
    """Every assistant turn of ``files`` as token ids, with the ``context`` tokens before it."""
    sequences: list[list[int]] = []
    stats = DataStats()
    for path in files:
        if not Path(path).is_file():
            raise MedusaError(f"--data file not found: {path}")
        for _, messages in tqdm(load_conversations(path, stats), desc=Path(path).name, file=sys.stderr):
            example = tokenize_conversation(tokenizer, messages, max_length=10**9)
            if example is None:
                continue
            ids, mask = example.input_ids, example.loss_mask
            t = 0
            while t < len(ids):
                if not mask[t]:
                    t += 1
                    continue
                end = t
                while end < len(ids) and mask[end]:
                    end += 1
                sequences.append(ids[max(0, t - context):end])
                t = end
    if not sequences:
        raise MedusaError(f"no assistant answers in {', '.join(files)}: pass files of the target's answers")
    return sequences


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = read_heads_config(args.heads)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    set_chat_template(tokenizer, args.chat_template)
    t0 = time.perf_counter()
    sequences = answer_sequences(tokenizer, args.data, args.max_n - 1)
    table = NgramTable.build(sequences, config.vocab_size, max_n=args.max_n, min_n=args.min_n,
                             min_count=args.min_count)
    path = Path(args.heads) / NGRAMS_NAME
    table.save(path)
    per_n = ", ".join(f"{n}: {len(table.keys[n]):,}" for n in sorted(table.keys))
    print(f"wrote {path}: {len(table):,} contexts ({per_n} by length) from {table.sequences:,} answers, "
          f"{table.corpus_tokens:,} tokens, {path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MedusaError as err:
        sys.exit(f"error: {err}")
