"""The soak test (medusa/bench/soak.py) against the real server on 127.0.0.1: mixed requests from
many clients, every good answer the one it gets alone, every bad one a 4xx, nothing left running.
A short soak runs in the development loop; the 1,000-request one in the peers tier."""

from __future__ import annotations

import os

import pytest
from test_serve import QUESTIONS, Running

from medusa.bench.soak import MIX, Soak, plan


def soak(n: int, clients: int):
    with Running(max_batch=4, max_queue=8, max_body=32 * 1024) as r:
        return Soak(r.url, "tiny", QUESTIONS, max_tokens=12, max_body=32 * 1024, pid=os.getpid()).run(n, clients)


def test_the_plan_mixes_every_kind_in_its_share():
    kinds = plan(1000, seed=0)
    assert len(kinds) == 1000 and plan(1000, seed=0) == kinds and plan(1000, seed=1) != kinds
    for kind, share in MIX:
        assert kinds.count(kind) == round(share * 1000)


def test_a_short_soak_passes_with_every_kind_checked():
    report = soak(150, clients=8)
    assert report.ok, report.lines()
    statuses = report.statuses
    assert statuses[200] > 0 and statuses[413] > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0
    assert not any(500 <= k for k in statuses)
    assert set(report.by_kind) == {kind for kind, _ in MIX}


@pytest.mark.peers
def test_a_thousand_mixed_requests_leave_the_server_idle_and_every_answer_exact():
    report = soak(1000, clients=16)
    assert report.ok, report.lines()
    assert report.idle_after and not any(500 <= k for k in report.statuses)
    memory = report.memory_mb
    assert memory["end"] < memory["start"] + 300, memory  # back near where it started, no per-request leak
