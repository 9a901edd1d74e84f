"""The bench's prompts: MT-Bench / Spec-Bench jsonl or ShareGPT json, chat-formatted to token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from medusa.decoding.engine import Engine
from medusa.errors import MedusaError

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "mt_bench.jsonl"  # package data


@dataclass
class Prompt:
    id: str
    category: str
    text: str
    ids: list[int] = field(default_factory=list)


def read_prompts(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """MT-Bench / Spec-Bench jsonl (``turns``: the first turn is used) or ShareGPT json
    (``conversations``: the first human turn). ``per_category`` keeps the first N of each
    category (MT-Bench is ordered by category, so a plain ``limit`` would see only one or two)."""
    path = Path(path)
    if not path.is_file():
        raise MedusaError(f"prompts file not found: {path}")
    records: list[dict] = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise MedusaError(f"{path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}): "
                          "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise MedusaError(f"{path}:{n} is not valid JSON") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise MedusaError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
        records = data if isinstance(data, list) else [data]
    prompts = []
    for i, rec in enumerate(records):
        if "turns" in rec and rec["turns"]:
            prompts.append(Prompt(str(rec.get("question_id", i)), str(rec.get("category", "all")), str(rec["turns"][0])))
        elif "conversations" in rec:
            first = next((t.get("value") for t in rec["conversations"] if t.get("from") == "human" and t.get("value")), None)
            if first:
                prompts.append(Prompt(str(rec.get("id", i)), "sharegpt", first))
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for pr in prompts:
            seen[pr.category] = seen.get(pr.category, 0) + 1
            if seen[pr.category] <= per_category:
                kept.append(pr)
        prompts = kept
    if limit:
        prompts = prompts[:limit]
    if not prompts:
        raise MedusaError(f"no prompts found in {path}: expected MT-Bench jsonl (turns) or ShareGPT json (conversations)")
    return prompts


def encode(engine: Engine, prompt: str) -> list[int]:
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tok(prompt)["input_ids"]
