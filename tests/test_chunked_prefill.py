"""A waiting prompt's prefill in chunks inside the running sequences' decoding passes
(medusa/decoding/batch.py ``Batch.step(prefill=)``, medusa/serving/scheduler.py ``prefill_rows``):
its cache holds the bits of its own prefill, every request's tokens are the tokens it gets alone,
and a pass that fails, sequences that end first or a prompt dropped midway change nothing else.
A tiny real Llama with EAGLE-3 heads (they read the prefill's hidden states) on the gemv kernels
built here."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tiny import hf_greedy, tiny_model

from medusa.decoding.batch import PREFILL_FLOOR, Batch
from medusa.decoding.engine import Engine
from medusa.decoding.generation import Done, Tokens
from medusa.decoding.plan import Plan
from medusa.decoding.request import make_request
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.serving.scheduler import Scheduler

LONG = [(7 * i) % 90 + 4 for i in range(70)]
OTHERS = [list(range(10, 30)), [5, 17, 33, 9]]


@pytest.fixture(scope="module")
def eng():
    model = tiny_model("llama")
    engine = Engine(model, heads=init_eagle3_for(model, 3), plan=Plan(kernels="gemv"))
    assert engine.passes.whole_calls  # the passes whose prompt rows are decoding rows
    return engine


def _run(eng: Engine, requests: list[dict], budget: int, others_new: int = 30, drop_at: int | None = None):
    """``OTHERS`` prefilled and running, then ``LONG`` (``requests[-1]``'s settings) prefilled in
    their passes, ``budget`` rows a pass; each run's tokens, the chunks each pass ran."""
    runs = [eng.decoding(make_request(p, max_new_tokens=others_new, mode="hybrid", ignore_eos=True))
            for p in OTHERS]
    runs.append(eng.decoding(make_request(LONG, **requests[-1])))
    batch, tokens, chunks = Batch(eng.passes, eng.max_rows), {id(r): [] for r in runs}, []
    with eng.owned():
        for run in runs[:2]:
            batch.add(run)
            while run not in batch.running:
                for r, event in batch.prefill()[1]:
                    tokens[id(r)] += event.ids
        batch.add(runs[2])
        assert batch.fusable()
        while batch:
            if drop_at is not None and len(chunks) == drop_at:
                held = weakref.ref(runs[2]._fused[0])
                batch.remove(runs[2])
                gc.collect()
                assert held() is None  # its cache (a KV store slot where there is one) went back
                drop_at = None
            report = batch.step(prefill=budget if batch.fusable() else None)
            chunks.append(report.chunk)
            for r, event in report.events:
                if isinstance(event, Tokens):
                    tokens[id(r)] += event.ids
                assert not isinstance(event, Done) or event.result.tokens == tokens[id(r)]
    return runs, [tokens[id(r)] for r in runs], chunks


def watch_chunks(sched: Scheduler) -> list[int]:
    """The prompt rows each of ``sched``'s steps runs in its pass, as they run."""
    seen, step = [], sched._batch.step

    def watched(caps=None, prefill=None):
        report = step(caps, prefill)
        seen.append(report.chunk)
        return report

    sched._batch.step = watched
    return seen


@pytest.mark.parametrize("settings", [dict(max_new_tokens=20, mode="hybrid", ignore_eos=True),
                                      dict(max_new_tokens=20, mode="baseline", temperature=0.8, seed=3,
                                           ignore_eos=True)], ids=["greedy", "sampled"])
def test_a_prompt_prefilled_in_decoding_passes_holds_its_own_prefills_bits(eng, settings, caplog):
    runs, got, chunks = _run(eng, [settings], budget=24)
    assert "verify one by one" not in caplog.text  # every chunk ran in the shared pass
    ran = [c for c in chunks if c]
    assert len(ran) >= 3 and sum(ran) == len(LONG)  # several chunks, beside the running sequences' rows
    assert all(c >= PREFILL_FLOOR for c in ran[:-1]) and max(ran) <= 24
    alone = eng.generate(LONG, **settings)
    assert got[2] == alone.tokens  # a sampled request draws the same tokens: the same logits, its own seed
    if settings.get("temperature") is None:
        assert alone.tokens == hf_greedy(eng.model, LONG, 20)
    mine, own = runs[2].state, alone.state
    assert torch.equal(mine.prefill_hidden, own.prefill_hidden)  # what the EAGLE-3 heads start from
    for a, b in zip(mine.cache.layers, own.cache.layers):
        assert torch.equal(a.keys[..., :len(LONG), :], b.keys[..., :len(LONG), :])
        assert torch.equal(a.values[..., :len(LONG), :], b.values[..., :len(LONG), :])
    for p, tokens in zip(OTHERS, got):  # the running sequences: their own tokens, chunks or not
        assert tokens == eng.generate(p, max_new_tokens=30, mode="hybrid", ignore_eos=True).tokens


def test_a_failed_shared_pass_runs_the_chunk_alone_and_changes_no_token(eng, monkeypatch, caplog):
    packed = eng.passes.verify_many

    def broken(items, prefill=None):
        if prefill is not None:
            raise RuntimeError("a fault in the shared pass")
        return packed(items)

    monkeypatch.setattr(eng.passes, "verify_many", broken)
    settings = dict(max_new_tokens=12, mode="hybrid", ignore_eos=True)
    runs, got, chunks = _run(eng, [settings], budget=20)
    assert "verify one by one" in caplog.text
    assert sum(chunks) == len(LONG)
    assert got[2] == eng.generate(LONG, **settings).tokens
    assert got[0] == eng.generate(OTHERS[0], max_new_tokens=30, mode="hybrid", ignore_eos=True).tokens


def test_a_prompt_whose_neighbours_end_first_goes_on_in_passes_of_its_own(eng):
    settings = dict(max_new_tokens=10, mode="hybrid", ignore_eos=True)
    runs, got, chunks = _run(eng, [settings], budget=18, others_new=2)
    assert sum(chunks) == len(LONG)
    assert got[:2] == [eng.generate(p, max_new_tokens=2, mode="hybrid", ignore_eos=True).tokens for p in OTHERS]
    assert got[2] == eng.generate(LONG, **settings).tokens == hf_greedy(eng.model, LONG, 10)


def test_a_prompt_dropped_midway_lets_its_cache_go_and_the_others_finish(eng):
    runs, got, chunks = _run(eng, [dict(max_new_tokens=10, mode="hybrid")], budget=20, drop_at=2)
    assert 0 < sum(chunks) < len(LONG) and got[2] == []
    assert got[1] == eng.generate(OTHERS[1], max_new_tokens=30, mode="hybrid", ignore_eos=True).tokens


def test_the_scheduler_prefills_a_long_prompt_beside_a_running_stream(eng):
    model = eng.model
    for rows in (20, 0):
        sched = Scheduler(eng, max_batch=2, prefill_rows=rows).start()
        seen = watch_chunks(sched)
        try:
            running = sched.submit(OTHERS[0], max_new_tokens=40, mode="baseline", ignore_eos=True)
            next(iter(running))  # decoding: the next prompt's prefill shares its passes
            late = sched.submit(LONG, max_new_tokens=8, mode="baseline").wait()
            first = running.wait()
        finally:
            sched.close(timeout=60)
        ran = [c for c in seen if c]
        assert (len(ran) >= 3 and sum(ran) == len(LONG)) if rows else not ran
        assert late.tokens == hf_greedy(model, LONG, 8)[:len(late.tokens)]
        assert first.tokens == hf_greedy(model, OTHERS[0], 40)


def test_prefill_rows_below_zero_is_one_line():
    model = tiny_model("llama")
    with pytest.raises(Exception, match="prefill_rows must be >= 0"):
        Scheduler(Engine(model, plan=Plan(kernels="gemv")), prefill_rows=-1)
