"""Conversations -> token ids + loss masks (the conversations come from ``sources.py``).

Tokenisation renders each conversation with the target's chat template; the loss mask is 1
exactly on the tokens of assistant turns (their text and end-of-turn marker). It runs as a
``datasets`` ``map`` (``num_proc`` worker processes, a progress bar) whose Arrow output is
cached under a fingerprint of the conversations, the tokenizer, its chat template, the
``max_length`` and the tokenising code: a second run with the same settings reads the rows back
instead of tokenising again, and any change tokenises afresh.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from transformers import PreTrainedTokenizerBase

from medusa.errors import MedusaError
from medusa.runtime.files import drop_cache_entry
from medusa.training.distributed import usable_cores
from medusa.training.sources import Conversation, DataStats, load_conversations

log = logging.getLogger("medusa.training.data")


@dataclass
class Example:
    """One tokenised training sequence."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens: the tokens heads learn to predict

    def __len__(self) -> int:
        return len(self.input_ids)


# -- tokenising --------------------------------------------------------------------------------

def chat_template(tokenizer: PreTrainedTokenizerBase) -> Any:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise MedusaError("the tokenizer has no chat template: use an instruction-tuned target or set tokenizer.chat_template")
    return template


def answer_token_ids(tokenizer: PreTrainedTokenizerBase, files: list[str]) -> torch.Tensor:
    """Every assistant turn's text of ``files`` (answers with ``messages``), tokenised without
    special tokens, as one ``[N]`` tensor: the fill of a draft vocabulary (``vocab_fill``)."""
    ids: list[int] = []
    for path in files:
        if not Path(path).is_file():
            raise MedusaError(f"vocab_fill file not found: {path}")
        for _, messages in load_conversations(path, DataStats()):
            for m in messages:
                if m["role"] == "assistant":
                    ids.extend(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


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
    return min(8, usable_cores())


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

    def rows() -> tuple[list, list]:
        with _progress_bars(progress):
            out = ds.map(tokenise_batch, batched=True, batch_size=64, num_proc=procs if procs > 1 else None,
                         fn_kwargs={"tokenizer": tokenizer, "max_length": max_length}, remove_columns=["messages"],
                         features=row_features, cache_file_name=str(folder / f"{fp}.arrow"), new_fingerprint=fp, desc=desc)
        ids, masks = (out.data.column(name).to_pylist() for name in ("input_ids", "loss_mask"))
        if len(ids) != len(conversations):
            raise ValueError(f"{len(ids)} rows for {len(conversations)} conversations")
        return ids, masks

    try:
        ids, masks = rows()
    except (OSError, ValueError) as err:  # pyarrow's errors for a cut-off or garbage cache file
        if not cached:
            raise
        damaged = sorted(folder.glob(f"{fp}*.arrow"))  # one file, or one per process that wrote it
        drop_cache_entry(damaged[0], f"damaged ({(str(err).strip().splitlines() or [type(err).__name__])[0][:120]})")
        for file in damaged[1:]:
            file.unlink(missing_ok=True)
        ids, masks = rows()
    return [Example(i, m) if i else None for i, m in zip(ids, masks)]


@dataclass
class DataSplits:
    train: list[Example]
    eval: list[Example]
    stats: DataStats
    fill: torch.Tensor | None = None  # token ids of vocab_fill's answers (answer_token_ids)


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
        mine = DataStats()
        convs = load_conversations(source, mine, split=split, max_samples=max_samples, seed=seed)
        stats.merge(mine)
        if not convs:  # empty, garbage, or records of another kind: say which source
            raise MedusaError(f"{source} holds no usable conversations ({mine.summary() or 'no records'}): pass a "
                              ".jsonl or .json file of conversations (ShareGPT or chat-messages form)")
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
