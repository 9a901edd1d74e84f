"""The scheduler's prompt cache: finished greedy requests' keys and values, kept by memory, for
later prompts that begin as they did (a chat's next turn resends its history; a system prompt or
a whole question repeats).

A finished request's cache is a KV store slot as long as the context window (or a private
buffer of its own); keeping it would hold that slot. Here only the positions that hold its tokens
are copied out, each layer's keys and values at their exact size, and the slot goes back with the
request. Entries are kept newest last within ``budget`` bytes, the oldest dropped first; an entry
whose tokens begin a newer one's (an earlier turn of the same conversation) is dropped for it, and
one that a kept entry already begins with adds nothing. A prompt then starts after the longest
prefix, at least ``min_shared`` tokens, it shares with one of them: the scheduler copies those
positions, the very bits its own prefill would compute where :func:`shares_prefixes
<medusa.serving.scheduler.shares_prefixes>` holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import torch
from transformers.cache_utils import Cache

from medusa.decoding.run import common_prefix
from medusa.decoding.state import DecodeState
from medusa.runtime import hf as kv


def compact(cache: Cache, length: int) -> Cache:
    """A cache holding a copy of the first ``length`` positions of ``cache``, exactly that long."""
    out = kv.new_cache(buffered=False)
    with torch.inference_mode():
        for i, layer in enumerate(cache.layers):
            out.update(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone(), i)
    return out


class PrefixCache:
    """Finished requests' tokens and keys and values within ``budget`` bytes (``per_token``:
    one position's keys and values, every layer); see the module docstring."""

    def __init__(self, budget: int, per_token: int, min_shared: int = 8) -> None:
        self.budget, self.per_token, self.min_shared = budget, per_token, min_shared
        self._entries: deque[DecodeState] = deque()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def add(self, state: DecodeState) -> None:
        """Keep a copy of what ``state``'s cache holds of its tokens (a finished request's)."""
        n = min(state.valid, state.length)
        if n < self.min_shared or n * self.per_token > self.budget:
            return
        tokens = state.tokens[:n]
        if any(len(e.tokens) >= n and e.tokens[:n] == tokens for e in self._entries):
            return  # a kept entry begins with all of it
        for old in [e for e in self._entries if len(e.tokens) < n and tokens[:len(e.tokens)] == e.tokens]:
            self._drop(old)  # it begins this one: this one serves every prompt it would
        empty = torch.empty(0)
        self._entries.append(replace(state, cache=compact(state.cache, n), tokens=tokens, length=n, valid=n,
                                     root=state.root.detach().clone(), hidden=empty, logits=empty, generator=None,
                                     prefill_hidden=None, share=None, carry={}, penalties=None, budget=None))
        self.bytes += n * self.per_token
        while self.bytes > self.budget:
            self._drop(self._entries[0])

    def longest(self, ids: list[int]) -> tuple[DecodeState | None, int]:
        """The entry sharing the longest prefix with ``ids`` (at least ``min_shared`` tokens; the
        newest of equals) and that prefix's length; ``(None, 0)`` where none does."""
        best, shared = None, self.min_shared - 1
        for entry in reversed(self._entries):
            if entry.tokens[:self.min_shared] != ids[:self.min_shared]:
                continue
            n = common_prefix(entry.tokens, ids)
            if n > shared:
                best, shared = entry, n
        return (best, shared) if best is not None else (None, 0)

    def _drop(self, entry: DecodeState) -> None:
        self._entries.remove(entry)
        self.bytes -= entry.length * self.per_token
