"""One KV store for every sequence a server runs: a preallocated buffer per layer, a slot a sequence.

Why: each sequence's cache used to grow on its own (:class:`~medusa.runtime.hf.BufferedLayer`
doubles its buffer when full, copying what it holds), so a sequence of 1,100 positions held
buffers of 2,048 and the scheduler's KV memory budget, counted in positions, could be exceeded
by up to twice. Here every layer's keys (and values) of ``slots`` sequences of up to
``capacity`` positions are one tensor ``[slots, kv_heads, capacity, D]``, reserved once:

- reserved, not written: a slot takes physical memory (4 KiB pages) as its sequence's positions
  are written, never for positions it does not reach; what a slot has touched stays with the
  store for the next sequence (as llama-server's and vLLM's preallocated caches do);
- a sequence's cache (:meth:`KVStore.cache`) is a transformers cache whose layers are views of
  its slot, ``[1, kv_heads, capacity, D]``, the layout of a private buffer: the packed pass writes
  every sequence's rows and the one-call attention reads them as before;
- the slot goes back to the store when the cache is dropped (or :meth:`KVStore.release`).

A cache that would outgrow its slot raises (the scheduler admits a request only if its prompt and
``max_new_tokens`` fit the context, and the slots hold the whole context).
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers.cache_utils import DynamicCache

from medusa.errors import MedusaError
from medusa.runtime import hf as kv
from medusa.runtime.rows import attention_shape


class SlotLayer(kv.BufferedLayer):
    """A cache layer whose buffer is one slot of a :class:`KVStore` (``[1, kv_heads, capacity, D]``
    views); it never reallocates."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self._slot = (keys, values)  # [1, kv_heads, capacity, D] each

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf, self._vbuf = self._slot

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        if needed > self._kbuf.shape[-2]:
            raise MedusaError(f"a sequence of {needed} positions does not fit its KV store slot of "
                              f"{self._kbuf.shape[-2]}: make the store's capacity the context window")
        if key_states.shape[1] != self._kbuf.shape[1] or key_states.shape[-1] != self._kbuf.shape[-1]:
            raise MedusaError(f"keys of shape {tuple(key_states.shape)} do not fit a KV store of "
                              f"{self._kbuf.shape[1]} heads of {self._kbuf.shape[-1]}")


class KVStore:
    """Keys and values for ``slots`` sequences of up to ``capacity`` positions, per layer of
    ``model`` (see the module docstring); thread-safe."""

    def __init__(self, model, slots: int, capacity: int) -> None:
        if slots < 1 or capacity < 1:
            raise MedusaError(f"a KV store needs at least one slot of one position, got {slots} x {capacity}")
        config = kv.text_config(model)
        _, kv_heads, dim = attention_shape(model)
        dtype, device = model.dtype, model.get_output_embeddings().weight.device
        shape = (slots, kv_heads, capacity, dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.slots, self.capacity = slots, capacity
        self.bytes_per_position = 2 * config.num_hidden_layers * kv_heads * dim * self.keys[0].element_size()
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        """Slots no cache holds now."""
        with self._lock:
            return len(self._free)

    def cache(self) -> DynamicCache | None:
        """A cache on a free slot (None: every slot is taken); its slot is freed when it is dropped."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        cache = DynamicCache()
        cache.layers = [SlotLayer(k[slot:slot + 1], v[slot:slot + 1]) for k, v in zip(self.keys, self.values)]
        cache.layer_class_to_replicate = None
        # the slot comes back once: when the cache is dropped, or at release (the finalizer then dies)
        cache.kv_slot = weakref.finalize(cache, self._give_back, slot)
        return cache

    def release(self, cache: DynamicCache) -> None:
        """Free ``cache``'s slot now (the cache must not be used after)."""
        back = getattr(cache, "kv_slot", None)
        if back is not None:
            cache.layers = []
            back()

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
