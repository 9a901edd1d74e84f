"""A dynamic cache layer backed by a reusable buffer, written in place (:class:`BufferedLayer`):
every decoding cache's layer (medusa/runtime/hf.py's ``new_cache``), and a KV store slot's
(medusa/runtime/kvstore.py)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class _View:
    """A layer's ``keys`` or ``values``: made from its buffer where a length is held, first."""

    def __init__(self, slot: str) -> None:
        self.slot = slot

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        if layer.__dict__.get("held") is not None:
            layer._views()
        return layer.__dict__.get(self.slot)

    def __set__(self, layer, value: torch.Tensor | None) -> None:
        if layer.__dict__.get("held") is not None:
            layer._views()
        layer.__dict__[self.slot] = value


class BufferedLayer(DynamicLayer):
    """A full-length cache layer backed by a reusable buffer.

    ``keys``/``values`` are always views ``buffer[..., :length, :]``, so everything that
    reads a ``DynamicLayer`` (transformers' masks, ``get_seq_length``, our ``crop`` and
    ``keep_nodes``) works unchanged. ``update`` writes the new entries in place after
    ``length``, doubling the buffer when it is full: amortised O(new tokens) per step.
    """

    # ``keys``/``values`` live in the instance dict; after :meth:`hold` (a one-call pass wrote the
    # buffers in place, or a crop cut a held length) they are made when first read, not at every
    # step for every layer of every sequence
    keys = _View("_keys")
    values = _View("_values")

    def hold(self, length: int) -> None:
        """The buffers' first ``length`` positions are the cache (written in place): the views
        follow when read."""
        self.__dict__["held"] = length

    def _views(self) -> None:
        n, self.__dict__["held"] = self.__dict__["held"], None
        self.__dict__["_keys"], self.__dict__["_values"] = self._kbuf.narrow(-2, 0, n), self._vbuf.narrow(-2, 0, n)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        kbuf = self._kbuf
        if kbuf is not None and kbuf.shape[-2] >= needed and kbuf.shape[:-2] == key_states.shape[:-2]:
            return
        capacity = max(needed, 2 * (kbuf.shape[-2] if kbuf is not None else 0), 256)
        length = self.get_seq_length()
        new_k = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        new_v = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if length:
            new_k[..., :length, :] = self.keys
            new_v[..., :length, :] = self.values
        self._kbuf, self._vbuf = new_k, new_v
        self.keys, self.values = new_k[..., :length, :], new_v[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        self._reserve(key_states, value_states, end)
        self._kbuf[..., start:end, :] = key_states
        self._vbuf[..., start:end, :] = value_states
        self.keys = self._kbuf[..., :end, :]
        self.values = self._vbuf[..., :end, :]
        return self.keys, self.values
