"""Long prompts for the bench: code review, multi-document summarization and RAG at ~1k, 2k, 4k
and 8k tokens of the embedded model's chat template, none of them from MT-Bench or the heads'
training answers.

    python scripts/long_prompts.py --output docs/benchmarks/prompts/long-context.jsonl
    python -m infer.bench --prompts docs/benchmarks/prompts/long-context.jsonl --limit 6 \\
        --modes baseline,lookup,eagle3,hybrid       # the 1k and 2k prompts; a table per category

Sources, each named in its record's ``source``:
- code: modules of Python's own standard library (this interpreter's), asked for a review;
- summarization: assistant answers of ShareGPT conversations the heads never trained on (the
  self-distilled training files are excluded by id and prompt text), several documents to
  summarise one by one;
- rag: the same kind of documents, numbered, with a question about one of them.

Records are MT-Bench jsonl (``question_id``, ``category`` such as ``rag-2k``, ``turns``), ordered
by length, so ``--limit`` keeps the shorter ones. The same seed writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

from medusa.config import HelpFormatter, writable_folder
from medusa.errors import MedusaError
from medusa.training.sources import SHAREGPT, DataStats, answered_prompts, load_conversations, prompt_key

REPO = Path(__file__).resolve().parents[1]
EXCLUDE = sorted(str(p) for p in (REPO / "data" / "selfdistill").glob("*.jsonl.gz"))
LENGTHS = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 7800}  # 8k: room left for an answer in an 8,192 window
# pure-Python standard library modules, readable on their own
MODULES = ("textwrap", "shlex", "fractions", "statistics", "difflib", "calendar", "heapq", "bisect", "configparser",
           "argparse", "csv", "gettext", "glob", "fnmatch", "ipaddress", "json/decoder", "json/encoder", "queue",
           "sched", "string", "tabnanny", "timeit", "tokenize", "uuid", "zipapp", "colorsys", "dataclasses")
ASK = {
    "code": "Review the following Python code. Explain what its main classes and functions do, then suggest two "
            "concrete improvements and show the changed code.\n\n```python\n{body}\n```",
    "summarization": "Summarize each of the documents below in two sentences, in order, then say in one sentence "
                     "what they have in common.\n\n{body}",
    "rag": "Answer using only the documents below. Question: what does document [{k}] explain, and which steps or "
           "facts does it give? Quote it where you can and cite it as [{k}].\n\n{body}",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/long_prompts.py", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", required=True, help="the jsonl file to write")
    p.add_argument("--per-length", type=int, default=1, help="prompts of each category at each length (default 1)")
    p.add_argument("--seed", type=int, default=0)
    return p


def documents(seed: int, min_chars: int = 1500) -> list[tuple[str, str]]:
    """``(id, text)``: long assistant answers of ShareGPT conversations outside the training files."""
    ids, texts = answered_prompts(EXCLUDE)
    docs = []
    for cid, messages in load_conversations(SHAREGPT, DataStats(), seed=seed):
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        if cid.split(":", 1)[-1] in ids or prompt_key(first) in texts:
            continue
        answer = max((m["content"] for m in messages if m["role"] == "assistant"), key=len, default="")
        if len(answer) >= min_chars and answer.isascii():
            docs.append((cid, answer.strip()))
    return docs


def code_text(rng: random.Random) -> tuple[str, list[str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = [m for m in MODULES if (stdlib / f"{m}.py").is_file()]
    rng.shuffle(names)
    return "\n\n".join(f"# --- {m}.py ---\n" + (stdlib / f"{m}.py").read_text() for m in names), names


def fit(tokenizer, template: str, body: str, target: int, **fields) -> str:
    """The prompt with the longest prefix of ``body`` whose chat-formatted tokens stay within ``target``."""
    def tokens(n: int) -> int:
        text = template.format(body=body[:n], **fields)
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))

    lo, hi = 0, len(body)
    if tokens(hi) < target * 0.95:
        raise MedusaError(f"not enough text for a {target}-token prompt ({tokens(hi)} tokens): add sources")
    while lo < hi:  # the longest prefix within target
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tokens(mid) <= target else (lo, mid - 1)
    return template.format(body=body[:lo], **fields)


def numbered(docs: list[tuple[str, str]]) -> tuple[str, list[str]]:
    return "\n\n".join(f"[{i}] {text}" for i, (_, text) in enumerate(docs, 1)), [cid for cid, _ in docs]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        writable_folder(Path(args.output).parent, "--output")
        from transformers import AutoTokenizer

        from medusa.models.target import default_model_dir

        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        rng = random.Random(args.seed)
        docs = documents(args.seed)
        records, qid = [], 0
        for length, target in LENGTHS.items():
            for _ in range(args.per_length):
                code, modules = code_text(rng)
                picked = rng.sample(docs, min(len(docs), 70))
                summary_body, summary_ids = numbered(picked[:35])
                rag_body, rag_ids = numbered(picked[35:])
                k = rng.randint(1, 3)  # asked about an early document: it is in every length's prefix
                made = [("code", fit(tokenizer, ASK["code"], code, target), "python stdlib: " + ", ".join(modules)),
                        ("summarization", fit(tokenizer, ASK["summarization"], summary_body, target),
                         "sharegpt answers: " + ", ".join(summary_ids)),
                        ("rag", fit(tokenizer, ASK["rag"], rag_body, target, k=k), "sharegpt answers: " + ", ".join(rag_ids))]
                for category, text, source in made:
                    qid += 1
                    records.append({"question_id": qid, "category": f"{category}-{length}", "turns": [text],
                                    "source": source})
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} prompts written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
