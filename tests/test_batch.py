"""Batched decoding: every request's tokens are the tokens it gets alone, in every mode, for any
arrival pattern (threads sharing one engine, a failed prefill: tests/test_faults.py)."""

from __future__ import annotations

import pytest
from tiny import hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.generation import read
from medusa.errors import MedusaError
from medusa.models.block_heads import init_block_for
from medusa.models.draft import shallow_draft
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.eagle_heads import init_eagle_for
from medusa.models.loader import init_heads_for
from medusa.serving.budget import knee, share_rows
from medusa.serving.scheduler import Overloaded, Scheduler

# different lengths: one longer than the prefill chunk (PREFILL below), one a single token
PROMPTS = [[5, 17, 33, 9, 41, 12], [9, 8, 7] * 7, list(range(10, 40)), [5], [(7 * i) % 90 + 4 for i in range(45)]]
PREFILL = 16
N = 24


def engine_for(arch: str, mode: str) -> Engine:
    model = tiny_model(arch)
    heads, draft = None, None
    if mode in ("medusa", "hybrid"):
        heads = init_heads_for(model, num_heads=3)
    elif mode == "hybrid@eagle3" or mode == "eagle3":
        heads = init_eagle3_for(model, 3)
    elif mode == "eagle":
        heads = init_eagle_for(model, 3)
    elif mode == "block":
        heads = init_block_for(model, 4)
    elif mode == "draft":
        draft = shallow_draft(model, 1)
    eng = Engine(model, heads=heads, draft=draft)
    eng.prefill_chunk = PREFILL
    return eng


def run_mode(mode: str) -> str:
    return mode.split("@")[0]


def scheduled(eng: Engine, prompts, mode: str, row_budget: int, stagger: bool, **kwargs) -> list[list[int]]:
    """Each prompt's tokens through a scheduler: submitted together, or each after the previous
    one has produced tokens (requests joining running ones); short and long answers."""
    sched = Scheduler(eng, max_batch=3, row_budget=row_budget).start()
    try:
        streams, firsts = [], []
        for i, p in enumerate(prompts):
            streams.append(sched.submit(p, max_new_tokens=N - 3 * (i % 3), mode=mode, **kwargs))
            # with stagger, its first tokens before the next request: it runs, and the next joins it
            firsts.append(read(streams[-1].get(timeout=60), streams[-1]) or [] if stagger else [])
        return [first + [t for chunk in s for t in chunk] for first, s in zip(firsts, streams)]
    finally:
        sched.close(timeout=60)


def alone(eng: Engine, prompts, mode: str, **kwargs) -> list[list[int]]:
    return [eng.generate(p, max_new_tokens=N - 3 * (i % 3), mode=mode, **kwargs).tokens for i, p in enumerate(prompts)]


MODES = ["baseline", "lookup", "medusa", "hybrid", "eagle", "eagle3", "hybrid@eagle3", "block", "lookahead", "draft"]
ARCHS = ["llama", "qwen2", "mistral", "gemma3"]
FAST = {("llama", m) for m in ("baseline", "hybrid", "eagle3", "lookahead")} | {("mistral", "hybrid")}


# The llama row in every mode runs end to end (test-all); the other architectures' full rows, which
# differ from llama's only in their attention layouts (FAST has one of those), in the peers tier.
@pytest.mark.parametrize("arch, mode", [(a, m) if (a, m) in FAST else
                                        pytest.param(a, m, marks=pytest.mark.e2e if a == "llama" else pytest.mark.peers)
                                        for a in ARCHS for m in MODES])
def test_every_mode_batched_gives_each_request_its_own_tokens(arch, mode):
    """Alone (chunked prefill included) is the target's own greedy; batched, with requests
    submitted together under a tight row budget or joining running ones, each is the same."""
    eng = engine_for(arch, mode)
    ref = alone(eng, PROMPTS, run_mode(mode))
    for i, p in enumerate(PROMPTS):
        assert ref[i] == hf_greedy(eng.model, p, N - 3 * (i % 3))[: len(ref[i])]
    assert scheduled(eng, PROMPTS, run_mode(mode), row_budget=6, stagger=True) == ref
    if arch == "llama":
        assert scheduled(eng, PROMPTS, run_mode(mode), row_budget=64, stagger=False) == ref


def test_a_packed_pass_really_verifies_several_sequences():
    eng = engine_for("llama", "baseline")
    passes = []
    forward = eng.passes.verify_many
    eng.passes.verify_many = lambda items: passes.append(len(items)) or forward(items)
    sched = Scheduler(eng, max_batch=4).start()
    streams = [sched.submit(p, max_new_tokens=N, mode="baseline") for p in PROMPTS[:4]]
    [s.wait() for s in streams]
    sched.close()
    assert max(passes) == 4 and sched.max_seen == 4


def test_sampled_requests_draw_the_same_tokens_whatever_is_batched_with_them():
    eng = engine_for("llama", "hybrid")
    kwargs = {"temperature": 0.9, "top_p": 0.95}
    seeds = [11, 12, 13, 14, 15]
    ref = [eng.generate(p, max_new_tokens=N, mode="hybrid", seed=s, **kwargs).tokens for p, s in zip(PROMPTS, seeds)]
    sched = Scheduler(eng, max_batch=5, row_budget=5).start()
    streams = [sched.submit(p, max_new_tokens=N, mode="hybrid", seed=s, **kwargs) for p, s in zip(PROMPTS, seeds)]
    got = [s.wait().tokens for s in streams]
    sched.close()
    assert got == ref
    assert len({tuple(t) for t in got}) > 1


def test_a_cancelled_request_frees_its_slot_and_the_others_finish():
    eng = engine_for("llama", "baseline")
    sched = Scheduler(eng, max_batch=2).start()
    long = sched.submit(PROMPTS[2], max_new_tokens=500, mode="baseline")
    other = sched.submit(PROMPTS[0], max_new_tokens=N, mode="baseline")
    long.get(timeout=60)
    long.cancel()
    waiting = sched.submit(PROMPTS[1], max_new_tokens=N, mode="baseline")
    assert waiting.wait().tokens == eng.generate(PROMPTS[1], max_new_tokens=N, mode="baseline").tokens
    assert other.wait().tokens == eng.generate(PROMPTS[0], max_new_tokens=N, mode="baseline").tokens
    assert long.wait().finish_reason == "stopped"
    sched.close()


def test_a_full_queue_says_so_in_one_line():
    eng = engine_for("llama", "baseline")
    sched = Scheduler(eng, max_batch=1, max_queue=1)  # not started: nothing leaves the queue
    sched.submit(PROMPTS[0], max_new_tokens=4)
    sched.submit(PROMPTS[1], max_new_tokens=4)
    with pytest.raises(Overloaded, match="max_queue 1"):
        sched.submit(PROMPTS[2], max_new_tokens=4)
    sched.start().close(timeout=60)


def test_bad_requests_fail_at_submit_not_in_the_scheduler():
    eng = engine_for("llama", "baseline")
    sched = Scheduler(eng)
    with pytest.raises(MedusaError, match="outside the model's vocabulary"):
        sched.submit([5, 10_000], max_new_tokens=4)
    with pytest.raises(MedusaError, match="max_new_tokens"):
        sched.submit([5], max_new_tokens=0)


def test_the_knee_comes_from_the_pass_costs():
    # gemv-like: flat to 12 rows; torch-like: every row costs
    assert knee(((1, 20.0), (4, 21.0), (8, 24.0), (12, 29.0), (16, 34.0))) == 12
    assert knee(((1, 60.0), (2, 94.0), (4, 102.0), (16, 111.0))) == 1
    assert knee(None, "cpu") >= 1 and knee(None, "cuda") > knee(None, "cpu")


@pytest.mark.parametrize("wanted, fixed, budget", [
    ([13, 13, 13, 13], [False] * 4, 12), ([1, 9, 4], [False] * 3, 8), ([5, 5], [True, False], 6),
    ([13] * 8, [False] * 8, 8), ([2, 2], [False, False], 10)])
def test_shares_never_exceed_the_budget_and_keep_every_root(wanted, fixed, budget):
    shares = share_rows(wanted, fixed, budget)
    assert all(1 <= s <= w for s, w in zip(shares, wanted))
    assert all(s == w for s, w, f in zip(shares, wanted, fixed) if f)
    assert sum(shares) <= max(budget, sum(w for w, f in zip(wanted, fixed) if f) + fixed.count(False))
    if sum(wanted) <= budget:
        assert shares == wanted
    elif not any(fixed) and budget >= len(wanted):
        assert sum(shares) == budget  # the rows a cap leaves over are handed out, not wasted


def test_left_over_rows_rotate_between_the_sequences():
    firsts = [share_rows([13] * 8, [False] * 8, 12, offset=k) for k in range(8)]
    assert all(sum(s) == 12 and max(s) == 2 for s in firsts)
    assert {tuple(s) for s in firsts} != {tuple(firsts[0])}  # the extra rows move turn by turn
