"""A lone greedy sequence's check of whether drafting pays (medusa/decoding/payoff.py): the choice
from its own steps' numbers, and on a real engine and scheduler: plain steps where drafts keep
nothing, the same tokens either way, sampled requests untouched."""

from __future__ import annotations

import time

import pytest
import torch
from tiny import DRAFTING, hf_greedy, tiny_model

from medusa.decoding import payoff
from medusa.decoding.engine import Engine
from medusa.decoding.payoff import DECAY, EXPLORE, GRACE, LEAVE, WARMUP, Curves, DraftCheck
from medusa.decoding.proposers.hybrid import Hybrid
from medusa.decoding.proposers.lookup import PromptLookup
from medusa.decoding.request import make_request
from medusa.decoding.state import DecodeState, Proposal, Proposer
from medusa.decoding.tree import compile_tree
from medusa.serving.scheduler import Scheduler

PROMPT = [5, 17, 33, 9, 41, 12]
N = 40


class Wrong(Proposer):
    """Drafts a chain of a token the target never emits here, 3 ms a draft: every draft is
    rejected, and costs more than the pass it would save on a tiny target."""

    def __init__(self, token: int, depth: int = 3) -> None:
        self.token, self.depth = token, depth
        self.max_rows = depth + 1
        self.proposed = 0

    def propose(self, state: DecodeState) -> Proposal:
        self.proposed += 1
        time.sleep(0.003)
        k = max(0, min(self.depth, state.budget - 1))
        tokens = torch.tensor([int(state.root)] + [self.token] * k, device=state.root.device)
        return Proposal(tree=compile_tree([(0,) * d for d in range(1, k + 1)]), tokens=tokens, is_chain=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ref(model):
    return hf_greedy(model, PROMPT, N)


def never(ref: list[int]) -> int:
    return next(t for t in range(4, 96) if t not in ref)


def a_run(model):
    """A real sequence (its stats and flags are what the check reads and sets)."""
    engine = Engine(model)
    return engine.decoding(make_request(PROMPT, max_new_tokens=8, mode=Wrong(4)))


def drive(check: DraftCheck, run, steps: int, kept: int, seconds: float, draft: float = 0.0) -> list[bool]:
    """``steps`` steps: a drafting step keeps ``kept`` tokens in ``seconds``, ``draft`` of them
    drafting; which steps were plain."""
    plain = []
    for _ in range(steps):
        capped = check.cap(run) == 1
        assert run.lean == capped  # a plain step defers the heads' update
        if not capped:
            run.stats.draft_seconds += draft
        check.observe(run, 1 if capped else 4, 0 if capped else kept, seconds, 100)
        plain.append(capped)
    return plain


def explored(n: int) -> int:
    """Plain steps in ``n`` steps of drafts that never pay: WARMUP drafting steps, then one in EXPLORE."""
    rest = max(0, n - WARMUP)
    return rest - rest // EXPLORE


def test_drafting_that_pays_is_never_cut(model):
    run, check = a_run(model), DraftCheck()
    # 3 tokens a step in 15 ms, 5 of them drafting: a plain step's 10 ms gives one
    plain = drive(check, run, 100, kept=2, seconds=0.015, draft=0.005)
    assert not any(plain) and run.stats.plain_steps == 0
    assert check.ratio() == pytest.approx(3 / 0.015 * 0.010)


def test_drafting_that_loses_turns_plain_and_drafts_one_step_in_explore(model):
    run, check = a_run(model), DraftCheck()
    # nothing kept, 4 of a step's 14 ms drafting: a plain step is faster
    plain = drive(check, run, 60, kept=0, seconds=0.014, draft=0.004)
    assert plain[:WARMUP] == [False] * WARMUP  # the heads' first steps draft
    assert check.plain and run.stats.plain_steps == sum(plain) == explored(60)
    drafted = [i for i, p in enumerate(plain[WARMUP:]) if not p]
    assert drafted and all(b - a == EXPLORE for a, b in zip(drafted, drafted[1:])), plain
    assert check.ratio() == pytest.approx(0.010 / 0.014)


def test_a_looking_step_that_keeps_a_token_drafts_on_and_the_check_applies_after_grace(model):
    run, check = a_run(model), DraftCheck()
    drive(check, run, 40, kept=0, seconds=0.014, draft=0.004)
    assert check.plain
    # the next drafted step keeps 3: drafting resumes for GRACE steps whatever they keep, then the
    # check weighs them with the rest (faded by the plain steps in between)
    plain = drive(check, run, EXPLORE, kept=3, seconds=0.014, draft=0.004)
    assert plain[-1] is False and not check.plain and check.grace == GRACE
    plain = drive(check, run, GRACE, kept=0, seconds=0.014, draft=0.004)
    assert plain == [False] * GRACE and check.grace == 0
    plain = drive(check, run, 3 * EXPLORE, kept=0, seconds=0.014, draft=0.004)
    assert check.plain and sum(plain) > EXPLORE  # they kept nothing: plain again


def test_plain_steps_fade_the_estimates_as_drafting_steps_do(model):
    run, check = a_run(model), DraftCheck()
    drive(check, run, WARMUP + EXPLORE, kept=0, seconds=0.014, draft=0.004)
    before = check.tokens.weight
    plain = drive(check, run, EXPLORE, kept=1, seconds=0.014, draft=0.004)  # EXPLORE - 1 plain steps, then one drafting
    assert plain == [True] * (EXPLORE - 1) + [False]
    assert check.tokens.weight == pytest.approx(before * DECAY ** EXPLORE + 1.0)


def test_drafting_near_plain_speed_goes_on(model):
    run, check = a_run(model), DraftCheck()
    # a token a step, a plain step estimated at 0.96 of it: above LEAVE
    plain = drive(check, run, 60, kept=0, seconds=0.0100, draft=0.0004)
    assert LEAVE < check.ratio() < 1.0 and not any(plain)


def test_the_plain_time_takes_out_the_extra_rows_by_the_plans_curve_at_the_length(model):
    curves = Curves(((1, 10.0), (2, 12.0), (8, 20.0)), by_length=((1024, ((1, 20.0), (8, 40.0))),))
    assert curves.base(4) == pytest.approx(12.0 + 8.0 * 2 / 6) and curves.base(16) == pytest.approx(20.0 + 8.0 / 6 * 8)
    assert curves.extra(1, 5000) == 0.0 and curves.extra(4, 1023) == pytest.approx(1 - 10.0 / (12.0 + 8.0 / 3))
    assert curves.extra(4, 1024) == pytest.approx(1 - 20.0 / (20.0 + 20.0 * 3 / 7))
    run, check = a_run(model), DraftCheck(curves)
    assert check.cap(run) is None
    run.stats.draft_seconds += 0.002
    run.stats.update_seconds += 0.001
    run.stats.verify_seconds += 0.020
    check.observe(run, 4, 1, 0.025, 2000)
    assert check.plain_seconds.value == pytest.approx(0.025 - 0.002 - 0.001 - 0.020 * curves.extra(4, 2000))
    assert check.tokens.value == 2 and check.seconds.value == 0.025


def test_greedy_decoding_alone_goes_plain_where_drafts_keep_nothing_and_stays_exact(model, ref):
    engine = Engine(model)
    wrong = Wrong(never(ref))
    res = engine.generate(PROMPT, max_new_tokens=N, mode=wrong)
    assert res.tokens == ref
    assert res.stats.plain_steps == explored(N - 1)  # one token a step: N - 1 steps after the prefill's
    assert wrong.proposed == res.stats.steps - res.stats.plain_steps  # a plain step drafts nothing
    off = Engine(model, proposer_config=DRAFTING).generate(PROMPT, max_new_tokens=N, mode=Wrong(never(ref)))
    assert off.tokens == ref and off.stats.plain_steps == 0 and off.stats.steps == N - 1


def test_sampled_requests_keep_their_proposals(model, ref):
    wrong = Wrong(never(ref))
    res = Engine(model).generate(PROMPT, max_new_tokens=N, mode=wrong, temperature=0.8, seed=3)
    assert res.stats.plain_steps == 0 and wrong.proposed == res.stats.steps


def test_a_served_lone_sequence_checks_as_the_library_does_and_a_batch_stays_exact(model, ref):
    engine = Engine(model)
    sched = Scheduler(engine, max_batch=2).start()
    try:
        alone = sched.submit(PROMPT, max_new_tokens=N, mode=Wrong(never(ref))).wait()
        assert alone.tokens == ref and alone.stats.plain_steps == explored(N - 1)
        # two at once: the batch's policy gives each its rows, its own check does not
        both = [sched.submit(PROMPT, max_new_tokens=N, mode=Wrong(never(ref))) for _ in range(2)]
        results = [s.wait() for s in both]
    finally:
        sched.close()
    assert all(r.tokens == ref for r in results)


def test_the_checks_entry_points_leave_batches_and_unchecked_sequences_alone(model):
    run = a_run(model)
    assert run.check is not None  # greedy, a proposer that drafts
    assert payoff.caps([run, a_run(model)]) == [None, None]
    run.check = None
    assert payoff.caps([run]) == [None]


def test_describe_says_whether_the_check_runs(model):
    assert any(line.startswith("drafting    a greedy sequence alone") for line in Engine(model).describe())
    assert "drafting    every step drafts (check_drafting=False)" in Engine(model, proposer_config=DRAFTING).describe()


def test_static_trees_take_the_kernel_picks_pass_costs_for_the_check(model, tmp_path):
    from tiny_heads import random_heads

    from medusa.autotune.cache import PlanCache
    from medusa.autotune.planner import Planner
    from medusa.decoding.plan import Plan

    planner = Planner(True, PlanCache(tmp_path))
    assert planner.trees(model, random_heads(model), Plan.default(model), False).pass_ms is None  # nothing timed
    planner.pass_ms = {4: 13.0, 1: 10.0, 2: 11.0}  # as the kernel pick timed them
    plan = planner.trees(model, random_heads(model), Plan.default(model), False)
    assert plan.pass_ms == ((1, 10.0), (2, 11.0), (4, 13.0)) and plan.decision("trees").value == "calibrated"
    run = Engine(model, heads=random_heads(model), plan=plan).decoding(make_request(PROMPT, mode="medusa"))
    assert run.check.curves.extra(4, 100) == pytest.approx(1 - 10.0 / 13.0)


def test_a_step_beside_a_prompts_rows_counts_but_is_not_timed(model):
    run, check = a_run(model), DraftCheck()
    drive(check, run, WARMUP + 1, kept=0, seconds=0.014, draft=0.004)
    assert check.plain and check.cap(run) == 1
    check.observe(run, 1, 0, None, 100)  # a plain step beside a prompt's rows: still a plain step
    assert run.stats.plain_steps == 2 and check.since == 2
    seen = (check.drafted, check.seconds.weight)
    check.plain = False
    assert check.cap(run) is None
    check.observe(run, 4, 0, None, 100)  # a drafting one: its time says nothing of a step's cost
    assert (check.drafted, check.seconds.weight) == seen


def drive_options(check: DraftCheck, run, steps: int, full: tuple[int, float, float], lean: tuple[int, float]) -> list[str]:
    """``steps`` steps: a full one keeps ``full[0]`` tokens in ``full[1]`` seconds, ``full[2]`` of
    them drafting; a lean one keeps ``lean[0]`` in ``lean[1]``; which option each step took."""
    kinds = []
    for _ in range(steps):
        capped = check.cap(run) == 1
        kind = "plain" if capped else "lean" if run.lean else "full"
        kept, seconds, draft = {"plain": (0, 0.010, 0.0), "full": full, "lean": (*lean, 0.0)}[kind]
        run.stats.draft_seconds += draft
        check.observe(run, 1 if capped else 4, kept, seconds, 100)
        kinds.append(kind)
    return kinds


def test_a_lean_option_that_keeps_as_much_for_less_drafts_lean_and_one_step_in_explore_in_full(model):
    run, check = a_run(model), DraftCheck()
    run.proposer.alone = (3, 3)  # each full step's chain alone would have emitted its 3 tokens
    # full: 3 tokens in 15 ms, 5 of them the heads' drafting; lean: the same 3 in 10 ms
    kinds = drive_options(check, run, 40, full=(2, 0.015, 0.005), lean=(2, 0.010))
    assert kinds[:WARMUP] == ["full"] * WARMUP and check.lean and not check.plain
    full = [i for i, k in enumerate(kinds[WARMUP:]) if k == "full"]
    assert full and all(b - a == EXPLORE for a, b in zip(full, full[1:])), kinds
    assert run.stats.lean_steps == kinds.count("lean") > 0 and run.stats.plain_steps == 0
    assert check.ratio() == pytest.approx(3 / 0.010 * 0.010)


def test_a_lean_option_that_keeps_less_leaves_the_full_proposal(model):
    run, check = a_run(model), DraftCheck()
    run.proposer.alone = (1, 4)  # the chain alone would have kept none of the heads' 2
    kinds = drive_options(check, run, 40, full=(2, 0.015, 0.005), lean=(0, 0.010))
    assert kinds == ["full"] * 40 and not check.lean and run.stats.lean_steps == 0


class Heads(Proposer):
    """A heads proposer drafting a 3-token chain: the reference's next tokens (``ref``: always
    kept) or a token the target never emits (always rejected), ``sleep`` seconds a draft; on a
    lean step it drafts nothing, as EAGLE heads skip their levels."""

    def __init__(self, ref: list[int] | None, token: int = 0, sleep: float = 0.0) -> None:
        self.ref, self.token, self.sleep = ref, token, sleep
        self.max_rows, self.proposed = 4, 0

    def propose(self, state: DecodeState) -> Proposal:
        k = 0 if state.lean else max(0, min(3, state.budget - 1))
        self.proposed += not state.lean
        time.sleep(0.0 if state.lean else self.sleep)
        done = len(state.tokens) - len(PROMPT)  # emitted so far, the root included
        drafted = self.ref[done:done + k] if self.ref is not None else [self.token] * k
        tokens = torch.tensor([int(state.root)] + drafted, device=state.root.device)
        return Proposal(tree=compile_tree([(0,) * d for d in range(1, len(drafted) + 1)]), tokens=tokens,
                        is_chain=True)


class Seen(Hybrid):
    """Mode hybrid noting each full step's emitted tokens and its lean option's counterfactual."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[tuple[int, tuple[int, int] | None]] = []

    def update(self, state: DecodeState, outcome) -> None:
        super().update(state, outcome)
        if not state.lean:
            self.seen.append((len(outcome.tokens), self.alone))


def hybrid(heads: Proposer) -> Seen:
    device = torch.device("cpu")
    return Seen(heads, PromptLookup(device, num_tokens=4, max_ngram=2), device)


def test_hybrid_whose_heads_keep_nothing_drafts_its_chain_alone_and_stays_exact(model, ref):
    heads = Heads(None, token=never(ref), sleep=0.003)
    mode = hybrid(heads)
    res = Engine(model).generate(PROMPT, max_new_tokens=N, mode=mode)
    assert res.tokens == ref
    steps = res.stats.steps
    assert res.stats.lean_steps >= (steps - WARMUP) * (EXPLORE - 1) // EXPLORE - 1 > 0
    assert heads.proposed == steps - res.stats.lean_steps - res.stats.plain_steps  # a lean step drafts no heads
    # the heads kept nothing, so the chain alone would have emitted what each full step did
    assert mode.seen and all(alone == (emitted, alone[1]) for emitted, alone in mode.seen)


def test_hybrid_whose_heads_keep_more_than_its_chain_drafts_in_full(model, ref):
    mode = hybrid(Heads(ref))
    res = Engine(model).generate(PROMPT, max_new_tokens=N, mode=mode)
    assert res.tokens == ref and res.stats.lean_steps == 0 and res.stats.plain_steps == 0
    assert all(alone[0] <= emitted for emitted, alone in mode.seen)


def test_a_served_lone_hybrid_drafts_lean_as_the_library_does(model, ref):
    sched = Scheduler(Engine(model), max_batch=2).start()
    try:
        alone = sched.submit(PROMPT, max_new_tokens=N, mode=hybrid(Heads(None, never(ref), 0.003))).wait()
    finally:
        sched.close()
    assert alone.tokens == ref and alone.stats.lean_steps > 0
