"""An n-gram table of the target's own answers: lookup chains where the text has no match.

Prompt lookup copies a chain only where the last tokens occurred before in this prompt or
answer. A target's answers to *other* prompts repeat too - openers, list formatting, code
idioms, closing lines - so a heads folder may carry ``ngrams.safetensors``: for every context
of ``min_n``..``max_n`` tokens seen at least ``min_count`` times in a corpus of the target's
answers (its self-distilled training data), the token that followed it most often. When the
text itself has no match, mode ``hybrid`` drafts its chain from the table instead: each next
token from the longest known context, until no context is known (retrieval-based drafting in
the manner of REST, as a table rather than a suffix array).

Contexts are keyed by a 64-bit hash of their tokens (a collision costs at most a wasted draft
token: the target verifies every one). An entry whose prediction equals what its one-shorter
suffix predicts is dropped, as the lookup backs off to that suffix anyway: the table answers
exactly as the full one would, at a fraction of its size.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from medusa.errors import MedusaError
from medusa.runtime.files import atomic_file

NGRAMS_NAME = "ngrams.safetensors"
FORMAT = "medusa-ngrams-1"
_MULT = 1_000_003
_MASK = (1 << 64) - 1


def context_hash(tokens: Iterable[int]) -> int:
    """The key of a context: a polynomial hash of its tokens modulo 2**64."""
    h = 0
    for t in tokens:
        h = (h * _MULT + t + 1) & _MASK
    return h


def _hashes(flat: np.ndarray, n: int) -> np.ndarray:
    """[len(flat)] keys of the ``n`` tokens before each position (garbage before position ``n``)."""
    h = np.zeros(len(flat), dtype=np.uint64)
    ids = flat.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        for j in range(n, 0, -1):  # tokens[i - j] for j = n .. 1, oldest first
            h[n:] = h[n:] * np.uint64(_MULT) + ids[n - j: len(flat) - j]
    return h


class NgramTable:
    """Most frequent next token per context of ``min_n``..``max_n`` tokens (see the module docstring)."""

    def __init__(self, keys: dict[int, np.ndarray], tokens: dict[int, np.ndarray], vocab_size: int,
                 min_count: int, sequences: int = 0, corpus_tokens: int = 0) -> None:
        self.keys = keys  # n -> sorted uint64 context keys
        self.tokens = tokens  # n -> int64 next token per key
        self.vocab_size = vocab_size
        self.min_count = min_count
        self.sequences, self.corpus_tokens = sequences, corpus_tokens
        self.ngrams = sorted(keys, reverse=True)  # longest context first

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys.values())

    @classmethod
    def build(cls, sequences: Iterable[list[int]], vocab_size: int, max_n: int = 4, min_n: int = 2,
              min_count: int = 2) -> NgramTable:
        """Count every (context, next token) of the ``sequences`` (token lists; contexts never
        span two of them) and keep, per context seen with one next token at least ``min_count``
        times, its most frequent next token (the smallest id among ties)."""
        if not 1 <= min_n <= max_n or min_count < 1:
            raise MedusaError(f"an n-gram table needs 1 <= min_n <= max_n and min_count >= 1, "
                              f"got {min_n}, {max_n}, {min_count}")
        seqs = [list(s) for s in sequences]
        flat = np.fromiter((t for s in seqs for t in [-1] + s), dtype=np.int64)  # -1 separates sequences
        if flat.size and (flat.max() >= vocab_size):
            raise MedusaError(f"a sequence holds token {int(flat.max())}, outside the vocabulary of {vocab_size}")
        # run[i]: how many real tokens precede position i without a separator between
        starts = np.maximum.accumulate(np.where(flat < 0, np.arange(len(flat)), 0))
        run = np.arange(len(flat)) - starts
        keys: dict[int, np.ndarray] = {}
        best: dict[int, np.ndarray] = {}
        hashes = {n: _hashes(flat, n) for n in range(min_n, max_n + 1)}  # per position, its context's key
        for n in hashes:
            at = np.flatnonzero((flat >= 0) & (run > n))  # positions with n real tokens before them
            ctx, nxt = hashes[n][at], flat[at]
            order = np.lexsort((nxt, ctx))
            ctx, nxt = ctx[order], nxt[order]
            pair = np.ones(len(ctx), dtype=bool)
            pair[1:] = (ctx[1:] != ctx[:-1]) | (nxt[1:] != nxt[:-1])
            first = np.flatnonzero(pair)
            counts = np.diff(np.append(first, len(ctx)))
            pctx, pnxt = ctx[first], nxt[first]
            # per context, the pair with the highest count (stable: the smallest token among ties)
            order = np.lexsort((pnxt, -counts, pctx))
            head = np.ones(len(order), dtype=bool)
            head[1:] = pctx[order][1:] != pctx[order][:-1]
            top = order[head]
            kept = top[counts[top] >= min_count]
            keys[n], best[n] = pctx[kept], pnxt[kept]
        return cls._pruned(keys, best, hashes, flat >= 0, run, vocab_size, min_count, len(seqs),
                           int((flat >= 0).sum()))

    @classmethod
    def _pruned(cls, keys, best, hashes, real, run, vocab_size, min_count, sequences, corpus_tokens) -> NgramTable:
        """Drop entries that predict what their one-shorter suffix predicts (the lookup backs off
        to it): decided on the full tables, so every lookup answers as before."""
        pruned_keys, pruned_best = {}, {}
        ns = sorted(keys)
        for n in ns:
            if n == ns[0]:
                pruned_keys[n], pruned_best[n] = keys[n], best[n]
                continue
            # one position per context: its key at n and its suffix's at n - 1
            at = np.flatnonzero(real & (run > n))
            long_keys, short_keys = hashes[n][at], hashes[n - 1][at]
            where = np.searchsorted(keys[n], long_keys).clip(max=max(len(keys[n]) - 1, 0))
            hit = keys[n][where] == long_keys if len(keys[n]) else np.zeros(len(at), dtype=bool)
            suffix = np.zeros(len(keys[n]), dtype=np.uint64)
            suffix[where[hit]] = short_keys[hit]
            j = np.searchsorted(keys[n - 1], suffix).clip(max=max(len(keys[n - 1]) - 1, 0))
            same = np.zeros(len(keys[n]), dtype=bool)
            if len(keys[n - 1]):
                same = (keys[n - 1][j] == suffix) & (best[n - 1][j] == best[n])
            pruned_keys[n], pruned_best[n] = keys[n][~same], best[n][~same]
        return cls(pruned_keys, pruned_best, vocab_size, min_count, sequences, corpus_tokens)

    # -- lookup -----------------------------------------------------------------------------
    def next_token(self, context: list[int]) -> int | None:
        """The token most often after the longest known suffix of ``context`` (None: none known)."""
        for n in self.ngrams:
            if len(context) < n:
                continue
            keys = self.keys[n]
            key = np.uint64(context_hash(context[-n:]))
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                return int(self.tokens[n][i])
        return None

    def chain(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens, each the table's next token after the context and the ones before it."""
        longest = self.ngrams[0] if self.ngrams else 0
        tail = list(context[-longest:]) if longest else []
        out: list[int] = []
        for _ in range(k):
            token = self.next_token(tail)
            if token is None:
                break
            out.append(token)
            tail = (tail + [token])[-longest:]
        return out

    # -- files ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the table as safetensors (atomically: a crash never leaves half a file)."""
        from safetensors.numpy import save_file

        tensors = {}
        for n in self.keys:
            tensors[f"keys.{n}"] = self.keys[n].astype(np.uint64)
            tensors[f"tokens.{n}"] = self.tokens[n].astype(np.int32)
        meta = {"format": FORMAT, "vocab_size": str(self.vocab_size), "min_count": str(self.min_count),
                "sequences": str(self.sequences), "corpus_tokens": str(self.corpus_tokens)}
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> NgramTable:
        """Read a table; ``vocab_size``: the heads' (a table made for another vocabulary is an error,
        and so is a file that is cut off or not a table: one line naming it)."""
        from safetensors import SafetensorError, safe_open

        rebuild = "rebuild it with scripts/build_ngrams.py (or delete it: the heads work without it)"
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise MedusaError(f"{path} is not an n-gram table of this version (format {meta.get('format')!r}): "
                                      + rebuild)
                ns = sorted({int(name.split(".")[1]) for name in f.keys()})
                keys = {n: f.get_tensor(f"keys.{n}").astype(np.uint64) for n in ns}
                tokens = {n: f.get_tensor(f"tokens.{n}").astype(np.int64) for n in ns}
            table = cls(keys, tokens, int(meta["vocab_size"]), int(meta["min_count"]),
                        int(meta.get("sequences", 0)), int(meta.get("corpus_tokens", 0)))
        except (SafetensorError, OSError, ValueError, KeyError, IndexError) as err:
            why = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise MedusaError(f"{path} is damaged ({why}): {rebuild}") from None
        if vocab_size is not None and table.vocab_size != vocab_size:
            raise MedusaError(f"{path} was built for a vocabulary of {table.vocab_size} tokens, the heads have "
                              f"{vocab_size}: rebuild it with scripts/build_ngrams.py for this target")
        return table
