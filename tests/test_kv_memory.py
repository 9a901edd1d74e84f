"""Admission by KV memory (medusa/serving/scheduler.py): a request waits while its cache would not
fit beside the running ones', and still gets the answer it gets alone."""

from __future__ import annotations

import pytest

from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.serving.scheduler import Scheduler, default_kv_memory, kv_bytes_per_token
from tests.tiny import tiny_model

PROMPTS = [[5, 17, 33, 9], [9, 8, 7, 6], [11, 12, 13, 14], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def eng():
    return Engine(tiny_model("llama"))


def run_all(eng, kv_memory):
    sched = Scheduler(eng, max_batch=8, kv_memory=kv_memory)
    try:
        streams = [sched.submit(p, max_new_tokens=12, mode="baseline", ignore_eos=True) for p in PROMPTS]
        sched.start()
        return [s.wait().tokens for s in streams], sched.max_seen
    finally:
        sched.close(timeout=60)


def test_kv_memory_caps_how_many_run_at_once_not_what_they_answer(eng):
    per_token = kv_bytes_per_token(eng.model)
    assert per_token == 2 * 2 * 2 * 16 * 4  # keys and values x 2 layers x 2 KV heads x 16 dims x float32
    alone = [eng.generate(p, max_new_tokens=12, mode="baseline", ignore_eos=True).tokens for p in PROMPTS]
    need = per_token * (4 + 12 + 64)  # a request's prompt, max_new_tokens and a step's draft
    two, seen_two = run_all(eng, kv_memory=2 * need + need // 2)
    assert two == alone and seen_two == 2
    one, seen_one = run_all(eng, kv_memory=1)  # too small for any two: one at a time, each still runs
    assert one == alone and seen_one == 1
    many, seen_many = run_all(eng, kv_memory=None)
    assert many == alone and seen_many == 4


def test_bad_kv_memory_is_refused_and_the_default_is_some_of_this_machine(eng):
    with pytest.raises(MedusaError, match="kv_memory"):
        Scheduler(eng, kv_memory=0)
    assert 0 < default_kv_memory() < 2**50
