"""Requests as data: one function makes and checks them; a sequence's status; typed events
read in one place (medusa/decoding/request.py, medusa/decoding/generation.py)."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.generation import Done, Failed, Tokens, read
from medusa.decoding.request import Request, Status, make_request
from medusa.decoding.sampling import SamplingConfig
from medusa.errors import MedusaError
from medusa.serving.scheduler import Scheduler


@pytest.fixture(scope="module")
def eng() -> Engine:
    return Engine(tiny_model("llama"))


def test_make_request_checks_what_it_can_without_the_engine():
    with pytest.raises(MedusaError, match="input_ids is empty"):
        make_request([])
    with pytest.raises(MedusaError, match="max_new_tokens must be a whole number of at least 1"):
        make_request([5], max_new_tokens=0)
    with pytest.raises(MedusaError, match="max_new_tokens must be a whole number"):
        make_request([5], max_new_tokens=2.5)
    with pytest.raises(MedusaError, match="max_draft must be a whole number >= 0"):
        make_request([5], max_draft=-1)
    with pytest.raises(MedusaError, match="logprobs must be a whole number >= 0"):
        make_request([5], logprobs=True)
    with pytest.raises(MedusaError, match="generate and stream take token ids, not text"):
        make_request("hello")


def test_the_keyword_arguments_override_the_sampling_config():
    r = make_request([1, 2, 3], 7, "baseline", sampling=SamplingConfig(temperature=0.5, top_k=3), seed=11, top_k=5)
    assert r.prompt == (1, 2, 3) and r.max_new_tokens == 7 and r.mode == "baseline"
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.seed) == (0.5, 5, 11)
    assert make_request(r) is r  # a Request passes through unchanged


def test_a_request_and_its_keywords_decode_alike_and_the_engine_checks_the_rest(eng):
    r = make_request([5, 17, 33], max_new_tokens=9, mode="baseline")
    assert eng.generate(r).tokens == eng.generate([5, 17, 33], max_new_tokens=9, mode="baseline").tokens
    with pytest.raises(MedusaError, match="outside the model's vocabulary"):
        eng.decoding(make_request([5, 10_000]))
    with pytest.raises(MedusaError, match="greedy-only"):
        eng.decoding(make_request([5], mode="lookahead", temperature=0.7))


def test_a_sequence_says_where_it_is(eng):
    run = eng.decoding(make_request([5, 17, 33], max_new_tokens=4, mode="baseline"))
    assert run.status is Status.WAITING
    chunks = run.prefill_chunks()
    next(chunks, None)
    assert run.status is Status.PREFILLING
    for _ in chunks:
        pass
    run.first_chunk()
    assert run.status is Status.RUNNING
    run.begin()
    while (proposal := run.propose()) is not None:
        run.advance(eng.step(run.state, proposal))
    assert run.result().tokens and run.status is Status.FINISHED


def test_events_are_typed_and_read_in_one_place():
    class Into:
        result = error = None

    into = Into()
    assert read(Tokens([4, 5], drafted=1), into) == [4, 5]
    done = Done(result="r")
    assert read(done, into) is None and into.result == "r"
    boom = MedusaError("boom")
    with pytest.raises(MedusaError, match="boom"):
        read(Failed(boom), into)
    assert into.error is boom
    with pytest.raises(TypeError, match="not a generation event"):
        read(("tokens", [1]), into)


def test_a_scheduler_takes_a_request_and_its_events_are_typed(eng):
    sched = Scheduler(eng).start()
    try:
        stream = sched.submit(make_request([5, 17, 33], max_new_tokens=6, mode="baseline", max_draft=0))
        assert stream.max_draft == 0
        events = []
        while not events or not isinstance(events[-1], (Done, Failed)):
            events.append(stream.get(timeout=60))
        assert all(isinstance(e, Tokens) for e in events[:-1]) and isinstance(events[-1], Done)
        tokens = [t for e in events[:-1] for t in e.ids]
        assert tokens == events[-1].result.tokens == eng.generate([5, 17, 33], max_new_tokens=6).tokens
        assert stream.run.status is Status.FINISHED
        with pytest.raises(MedusaError, match="a Request or prompt ids with arguments, not both"):
            sched.submit(make_request([5]), max_new_tokens=3)
        # a listener takes the events instead of the stream's queue
        got = []
        listened = sched.submit([5, 17], max_new_tokens=3, listener=got.append)
        with pytest.raises(MedusaError, match="go to its listener"):
            listened.get(timeout=1)
    finally:
        sched.close(timeout=60)
    assert isinstance(got[-1], Done) and [t for e in got[:-1] for t in e.ids] == got[-1].result.tokens


def test_request_is_frozen_data():
    r = make_request([1])
    assert isinstance(r, Request)
    with pytest.raises(AttributeError):
        r.max_new_tokens = 3


def test_a_failed_pass_fails_only_the_request_it_belongs_to(eng):
    """Fault injection: every packed pass raises, and so does any pass over one request's cache.
    That request fails with one line; the others verify one by one and give their own tokens."""
    prompts = [[5, 17, 33, 9], [9, 8, 7, 6, 5], [11, 12, 13]]
    alone = [eng.generate(p, max_new_tokens=12, mode="baseline").tokens for p in prompts]
    passes = eng.passes
    verify = passes.verify
    poisoned = []

    def failing_many(items):
        raise RuntimeError("injected: the packed pass")

    def failing_one(cache, *args, **kwargs):
        if any(s.run.state is not None and s.run.state.cache is cache for s in poisoned):
            raise RuntimeError("injected: this request's pass")
        return verify(cache, *args, **kwargs)

    passes.verify_many, passes.verify = failing_many, failing_one
    sched = Scheduler(eng, max_batch=3)
    try:
        streams = [sched.submit(p, max_new_tokens=12, mode="baseline") for p in prompts]
        poisoned.append(streams[1])
        sched.start()
        with pytest.raises(MedusaError, match="decoding failed: injected: this request's pass"):
            streams[1].wait()
        assert streams[1].run.status is Status.FAILED
        assert [streams[0].wait().tokens, streams[2].wait().tokens] == [alone[0], alone[2]]
        assert sched.max_seen >= 2  # they did share steps: the packed pass was tried and undone
    finally:
        sched.close(timeout=60)
        del passes.verify_many, passes.verify  # the class's methods again
    assert eng.generate(prompts[1], max_new_tokens=12, mode="baseline").tokens == alone[1]
