"""One KV store for every running sequence (medusa/runtime/kvstore.py): a sequence's cache is a
slot of preallocated per-layer buffers, its answers and logits are those of its own buffers, the
slot comes back when the cache goes, and the scheduler runs its sequences on it."""

from __future__ import annotations

import gc

import pytest
import torch

from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.runtime import hf as kv
from medusa.runtime.kvstore import KVStore
from medusa.serving.scheduler import Scheduler, kv_bytes_per_token
from tests.tiny import tiny_model

PROMPTS = [[5, 17, 33, 9], [9, 8, 7, 6, 5], [11, 12, 13, 14, 15, 16], [20, 21, 22]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_a_slot_is_a_cache_in_the_store_s_memory_and_comes_back_when_dropped(model):
    store = KVStore(model, slots=2, capacity=64)
    a, b = store.cache(), store.cache()
    assert store.cache() is None and store.free == 0  # every slot taken
    kv.forward(model, torch.tensor([[3, 4, 5]]), torch.arange(3)[None], a, None)
    layer = a.layers[0]
    start, end = store.keys[0].data_ptr(), store.keys[0].data_ptr() + store.keys[0].nbytes
    assert start <= layer.keys.data_ptr() < end and a.get_seq_length() == 3  # written in place, no copy
    del a
    gc.collect()
    assert store.free == 1
    store.release(b)
    assert store.free == 2
    c = store.cache()  # a slot handed out again
    del b  # the released cache going away gives nothing back twice
    gc.collect()
    assert store.free == 1
    del c
    gc.collect()
    assert store.free == 2
    assert store.bytes_per_position == kv_bytes_per_token(model)


def test_a_sequence_on_a_slot_computes_the_bits_it_computes_on_its_own_buffers(model):
    eng = Engine(model)
    ids = torch.tensor([[7, 8, 9, 10, 11, 12]])
    own, slot = kv.new_cache(), KVStore(model, 1, 64).cache()
    for cache in (own, slot):
        kv.forward(model, ids, torch.arange(6)[None], cache, None)
    for new in ([13], [14, 15]):
        at = own.get_seq_length()
        positions = torch.arange(at, at + len(new))[None]
        mine = kv.forward(model, torch.tensor([new]), positions, own, None)[0]
        theirs = kv.forward(model, torch.tensor([new]), positions, slot, None)[0]
        assert torch.equal(mine, theirs)
    kv.crop(slot, 4)
    assert slot.get_seq_length() == 4
    alone = eng.generate(PROMPTS[0], max_new_tokens=10, mode="baseline", ignore_eos=True).tokens
    eng.passes.store = KVStore(model, 1, 256)
    try:
        assert eng.generate(PROMPTS[0], max_new_tokens=10, mode="baseline", ignore_eos=True).tokens == alone
    finally:
        eng.passes.store = None


def test_a_cache_that_would_outgrow_its_slot_says_so(model):
    cache = KVStore(model, 1, 8).cache()
    kv.forward(model, torch.arange(4, 10)[None], torch.arange(6)[None], cache, None)
    with pytest.raises(MedusaError, match="slot of 8"):
        kv.forward(model, torch.arange(4, 8)[None], torch.arange(6, 10)[None], cache, None)


@pytest.mark.parametrize("kv_memory", [None, 1])  # a slot for each sequence; one slot, the rest on their own
def test_the_scheduler_runs_its_sequences_on_its_store_with_the_answers_they_get_alone(model, kv_memory):
    eng = Engine(model)
    alone = [eng.generate(p, max_new_tokens=12, mode="baseline", ignore_eos=True).tokens for p in PROMPTS]
    sched = Scheduler(eng, max_batch=4, kv_memory=kv_memory)
    try:
        assert sched.store is eng.passes.store and sched.store.slots == (5 if kv_memory is None else 1)
        assert sched.store.capacity >= eng.passes.max_positions
        streams = [sched.submit(p, max_new_tokens=12, mode="baseline", ignore_eos=True) for p in PROMPTS]
        sched.start()
        assert [s.wait().tokens for s in streams] == alone
    finally:
        sched.close(timeout=60)
        eng.passes.store = None
