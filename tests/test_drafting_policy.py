"""The scheduler's per-turn drafting choice (medusa/serving/drafting.py): rows and drafter per
sequence from the pass's cost and what each sequence's drafts kept, and lean drafts that skip the
heads yet keep every token the target's own."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.request import make_request
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.serving.drafting import EXPLORE, Choice, DraftPolicy, Estimate
from medusa.serving.scheduler import Scheduler

PASS = ((1, 18.0), (2, 18.5), (4, 19.0), (8, 22.0), (16, 30.0))


def test_the_pass_cost_is_read_from_the_plan_between_and_beyond_its_sizes():
    policy = DraftPolicy(PASS, knee=12)
    assert policy.cost(4) == 19.0 and policy.cost(16) == 30.0
    assert policy.cost(6) == pytest.approx(20.5)  # halfway between 4 and 8 rows
    assert policy.cost(24) == pytest.approx(38.0)  # the last slope, 1 ms a row
    flat = DraftPolicy(None, knee=8)  # no timing: one pass up to the knee, then linear
    assert flat.cost(1) == flat.cost(8) == 1.0 and flat.cost(16) == 2.0


def test_expected_kept_tokens_follow_the_chain_rule():
    est = Estimate(keep=0.6, found=0.5, ms=1.0)
    assert est.gain(1) == 0.0
    assert est.gain(4) == pytest.approx(0.5 * (0.6 + 0.36 + 0.216))
    assert Estimate(keep=1.0, found=1.0, ms=0.0).gain(5) == 4.0


def _seen(policy, seq, lean, drafted, kept, ms, turns=12):
    for _ in range(turns):
        policy.observe(seq, Choice(drafted + 1, lean), drafted, kept, ms)


def test_each_sequence_drafts_only_where_its_drafts_pay_for_their_cost():
    policy = DraftPolicy(PASS, knee=12)
    copying, guessing, stuck = "copying", "guessing", "stuck"
    _seen(policy, copying, True, 4, 4, 0.1)  # a lookup chain the target keeps whole, nearly free
    _seen(policy, guessing, False, 3, 1, 9.0)  # heads that keep a token a turn at 9 ms
    _seen(policy, guessing, True, 0, 0, 0.1)  # and no chain to copy
    _seen(policy, stuck, True, 4, 0, 0.1)  # chains the target never keeps
    _seen(policy, stuck, False, 3, 0, 9.0)
    policy.turns = 1
    choices = policy.choose([copying, guessing, stuck], [5, 5, 5])
    assert choices[0] == Choice(5, True)  # the whole share, lean: the chain pays for its rows
    assert choices[1].rows == 1 or choices[1].lean  # 9 ms of heads buy more than their token as plain decoding
    assert choices[2].rows == 1  # drafts the target does not keep cost their rows
    cheap = DraftPolicy(PASS, knee=12)  # the same heads at 0.5 ms a turn are worth their rows
    _seen(cheap, guessing, False, 3, 2, 0.5)
    _seen(cheap, guessing, True, 0, 0, 0.1)
    cheap.turns = 1
    assert cheap.choose([guessing, stuck], [4, 4])[0] == Choice(4, False)


def test_exploring_turns_let_one_sequence_draft_as_alone_within_its_share():
    policy = DraftPolicy(PASS, knee=12)
    for seq in "ab":
        _seen(policy, seq, True, 4, 0, 0.1)
        _seen(policy, seq, False, 4, 0, 0.1)
    picked = {}
    for turn in range(1, 4 * EXPLORE + 1):
        picked[turn] = policy.choose(["a", "b"], [3, 3])
    explored = {t: c for t, c in picked.items() if c != [Choice(1, False)] * 2}
    assert sorted(explored) == [EXPLORE, 2 * EXPLORE, 3 * EXPLORE, 4 * EXPLORE]  # nothing else pays
    assert [sum(x.rows > 1 for x in c) for c in explored.values()] == [1] * 4  # one sequence at a time
    assert {i for c in explored.values() for i, x in enumerate(c) if x.rows > 1} == {0, 1}  # each in turn
    assert {x.lean for c in explored.values() for x in c if x.rows > 1} == {True, False}  # both options


def test_an_option_that_could_not_pay_if_every_draft_were_kept_is_not_explored():
    # eight sequences at a 24 ms turn: 1 row of share each way is worth at most one token, 0.33
    # of a turn's tokens per ms; heads at 6 ms a draft cannot pay for it, a 0.1 ms lookup chain can
    policy = DraftPolicy(PASS, knee=12)
    seqs = list("abcdefgh")
    for seq in seqs:
        _seen(policy, seq, True, 1, 0, 0.1)
        _seen(policy, seq, False, 1, 0, 6.0)
    explored = []
    for _ in range(2 * len(seqs) * EXPLORE):
        explored += [c for c in policy.choose(seqs, [2] * 8) if c.rows > 1]
    assert explored and all(c.lean for c in explored)  # the lean option explored, the heads never


def test_estimates_follow_recent_turns_and_start_from_the_batchs():
    policy = DraftPolicy(PASS, knee=12)
    _seen(policy, "old", True, 4, 4, 0.1)
    fresh = policy.estimate("new", "lean")  # nothing of its own: the pooled rates
    assert fresh.keep > 0.9 and fresh.found == pytest.approx(1.0)
    _seen(policy, "old", True, 4, 0, 0.1, turns=20)  # the answer stopped repeating its prompt
    assert policy.estimate("old", "lean").keep < 0.2
    policy.forget("old")
    assert "old" not in policy.seqs


def test_a_lean_step_drafts_the_lookup_chain_without_the_heads():
    model = tiny_model("llama", num_hidden_layers=2)
    eng = Engine(model, heads=init_eagle3_for(model, 3))
    prompt = [5, 17, 33, 9, 41, 12] * 6
    plain = eng.generate(prompt, max_new_tokens=40, mode="baseline", ignore_eos=True).tokens
    run = eng.decoding(make_request(prompt, max_new_tokens=40, mode="hybrid", ignore_eos=True))
    for _ in run.prefill_chunks():
        pass
    run.first_chunk()
    run.begin()
    heads, chains = run.proposer.heads, 0
    while True:
        run.lean = run.stats.steps % 2 == 0  # lean and full steps in turn
        proposal = run.propose(8)
        if proposal is None:
            break
        if run.lean:
            assert heads.ranked == []  # the heads drafted nothing
            copied = run.proposer.lookup.propose(run.state)
            assert proposal.tokens.tolist() == copied.tokens[: proposal.tokens.shape[0]].tolist()
            chains += proposal.tokens.shape[0] > 1
        else:
            assert heads.ranked  # the heads draft again
        run.advance(eng.step(run.state, proposal))
    assert chains > 0  # the answer repeats itself: lean steps copied chains
    assert run.result().tokens == plain


def test_batched_answers_stay_the_target_s_own_whatever_each_turn_drafts():
    model = tiny_model("llama", num_hidden_layers=2)
    eng = Engine(model, heads=init_eagle3_for(model, 3))
    prompts = [[5, 17, 33, 9, 41, 12] * 4, [9, 8, 7] * 7, list(range(10, 40)), [(7 * i) % 90 + 4 for i in range(30)]]
    alone = [eng.generate(p, max_new_tokens=40, mode="baseline", ignore_eos=True).tokens for p in prompts]
    sched = Scheduler(eng, max_batch=4, row_budget=12).start()
    try:
        streams = [sched.submit(p, max_new_tokens=40, mode="hybrid", ignore_eos=True) for p in prompts]
        assert [s.wait().tokens for s in streams] == alone
    finally:
        sched.close(timeout=60)
    seen = sched.policy.pool
    assert seen["lean"].turns > 0 and seen["full"].turns > 0  # both kinds of draft ran
    assert sched.policy.seqs == {}  # finished sequences are forgotten


@pytest.mark.parametrize("window", [None, 8])
def test_lean_steps_defer_the_heads_update_and_catch_up_to_the_same_cache(window):
    import medusa

    model = tiny_model("llama", num_hidden_layers=2)
    eng = Engine(model, heads=init_eagle3_for(model, 3), proposer_config=medusa.ProposerConfig(draft_window=window))
    prompt = [(7 * i + 3) % 90 + 2 for i in range(20)]

    def decode(lean_from: int, lean_to: int):
        run = eng.decoding(make_request(prompt, max_new_tokens=30, mode="eagle3", ignore_eos=True))
        for _ in run.prefill_chunks():
            pass
        run.first_chunk()
        run.begin()
        heads, drafts = run.proposer, []
        while True:
            run.lean = lean_from <= run.stats.steps < lean_to
            proposal = run.propose(1 if run.lean else None)  # plain steps while lean, as a batch runs them
            if proposal is None:
                return run.result().tokens, drafts, heads
            if not run.lean:
                drafts.append(proposal.tokens.tolist())
            run.advance(eng.step(run.state, proposal))
            assert bool(heads.pending) == run.lean  # a lean step's pairs wait; a drafting step fed them

    tokens, drafts, eager = decode(0, 0)
    later, late_drafts, lazy = decode(3, 14)
    assert later == tokens  # the heads change speed, never tokens
    assert lazy.pending == [] and (lazy.start, lazy.length) == (eager.start, eager.length)
    if window is not None:
        assert lazy.length - lazy.start == window
    assert late_drafts[-1] == drafts[-1]  # caught up: the same draft at the last step as fed step by step


def test_the_overhead_of_a_drafting_sequence_is_fitted_from_the_turns():
    policy = DraftPolicy(PASS, knee=12)
    assert policy.overhead() == (0.0, 0.0)
    for drafted in [0, 1, 2, 3, 4] * 6:  # turns of 4 rows: 2 ms, plus 0.5 ms a drafting sequence
        policy.turn_took((policy.cost(4) + 2.0 + 0.5 * drafted + 1.0) / 1000, 4, 1.0, drafted)
    base, per_draft = policy.overhead()
    assert base == pytest.approx(2.0) and per_draft == pytest.approx(0.5)
    _seen(policy, "s", True, 2, 2, 0.0)
    policy.turns = 1
    assert policy.choose(["s"], [3])[0].rows == 3  # chains kept whole pay for 0.5 ms
    slow = DraftPolicy(PASS, knee=12)
    for drafted in [0, 1, 2, 3, 4] * 6:  # the same turns where a drafting sequence costs 60 ms more
        slow.turn_took((slow.cost(4) + 2.0 + 60 * drafted + 1.0) / 1000, 4, 1.0, drafted)
    _seen(slow, "s", True, 2, 2, 0.0)
    slow.turns = 1
    assert slow.choose(["s"], [3])[0].rows == 1
