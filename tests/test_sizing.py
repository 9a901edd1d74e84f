"""EAGLE trees and hybrid's lookup chain sized from this machine's measured pass costs."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch
from test_eagle import PROMPT, noisy_eagle
from tiny import DRAFTING, hf_greedy, tiny_model

from medusa.autotune.cache import PlanCache
from medusa.autotune.planner import Planner
from medusa.autotune.sizing import SIZES, bucketed, drafting_ms, monotone
from medusa.autotune.trees import Acceptance, acceptance_by_size, choose_dynamic, shallower
from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.decoding.proposers.eagle import DynamicTree, EagleProposer
from medusa.decoding.proposers.factory import LOOKUP_TOKENS, ProposerConfig
from medusa.decoding.proposers.hybrid import Hybrid
from medusa.decoding.proposers.lookup import MATCH_TOKENS
from medusa.models.loader import init_heads_for

# one draft shape: 0, 1 or 2 nodes, with a lookup chain of 0, 1 or 2 tokens beside them that
# half of the steps have
CURVES = {(3, 1): Acceptance(accepted=[0.5, 0.6], draft_ms=1.0,
                             hybrid=[[0.0, 0.5, 0.6], [0.4, 0.7, 0.8], [0.6, 0.8, 0.9]],
                             chain_share=[[0.0] * 3, [0.5] * 3, [0.5] * 3])}
COST = {1: 10.0, 2: 10.0, 3: 10.0, 4: 20.0, 10: 50.0}


def test_hybrid_sizing_pays_for_the_chain_rows_it_adds():
    # by hand, tokens/s = (1 + accepted) / (E[T(1 + n + chain rows)] + drafting if n) * 1e3:
    # no chain (mode eagle): n=1 1.5/11, n=2 1.6/11 (145.5)
    # chain 1: n=0 1.4/10 = 140, n=1 1.7/(10 + 1) = 154.5, n=2 1.8/(15 + 1)
    # chain 2: n=0 1.6/(0.5 T(1) + 0.5 T(3)) = 160 (the best), n=1 1.8/16, n=2 1.9/(0.5 T(3) + 0.5 T(5) + 1)
    size, expected, tps = choose_dynamic(CURVES, COST, hybrid=True)
    assert (size.nodes, size.chain) == (0, 2) and expected == pytest.approx(1.6) and tps == pytest.approx(160)
    size, expected, tps = choose_dynamic(CURVES, COST)  # mode eagle: no chain
    assert (size.nodes, size.depth, size.topk, size.chain) == (2, 3, 1, None) and tps == pytest.approx(1.6 / 11 * 1e3)
    # passes of at most 2 rows: chain 1 beside no node (140) beats one node alone (136.4)
    size, _, tps = choose_dynamic(CURVES, COST, hybrid=True, max_rows=2)
    assert (size.nodes, size.chain) == (0, 1) and tps == pytest.approx(140)
    # a steep pass: nothing beside the root pays, so plain decoding (no tree, no chain)
    size, expected, _ = choose_dynamic(CURVES, {1: 10.0, 2: 40.0, 3: 80.0}, hybrid=True)
    assert (size.nodes, size.chain) == (0, 0) and expected == 1.0
    # curves calibrated before decoding was replayed: the per-position average, the chain left to the engine
    old = {shape: Acceptance([0.5, 0.9], acc.draft_ms) for shape, acc in CURVES.items()}
    size, expected, _ = choose_dynamic(old, COST, hybrid=True)
    assert (size.nodes, size.chain) == (2, None) and expected == pytest.approx(1.9)


def test_hybrid_sizing_pays_only_for_chain_rows_the_tree_does_not_hold():
    # the same curves, but the chain's first token is mostly one of the tree's nodes: with
    # 2 nodes, a 1-token chain adds no row and a 2-token one adds 1 (of 2 rows)
    shared = {shape: Acceptance(acc.accepted, acc.draft_ms, acc.hybrid, acc.chain_share,
                                chain_rows=[[0.0] * 3, [1.0, 1.0, 0.0], [2.0, 2.0, 1.0]])
              for shape, acc in CURVES.items()}
    # chain 2 beside 2 nodes now costs 0.5 T(3) + 0.5 T(4) + 1 = 16: 1.9 / 16 = 118.75 (was 1.9 / 21);
    # chain 1 beside 2 nodes: T(3) + 1 = 11: 1.8 / 11 = 163.6, the best (chain 2 alone: 160)
    size, expected, tps = choose_dynamic(shared, COST, hybrid=True)
    assert (size.nodes, size.chain) == (2, 1) and expected == pytest.approx(1.8) and tps == pytest.approx(1.8 / 11 * 1e3)


def test_acceptance_with_a_lookup_chain_replays_decoding():
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_decoder().norm.weight.fill_(0.0)  # greedy answer: token 0 throughout
    answer = hf_greedy(model, PROMPT, 10)
    assert set(answer) == {0} and 0 not in PROMPT
    heads = noisy_eagle(model)
    result = acceptance_by_size(heads, model, [(PROMPT, answer)], DynamicTree(nodes=2, depth=2, topk=1), chain=3)
    # Positions i = 0..8 have 9 - i true tokens ahead; N nodes get min(N, 9 - i) right. Lookup
    # finds no earlier 0 at i = 0 (no chain), then copies the repeating zeros: min(L, 9 - i) right.
    # Replayed by hand (a step at i accepting a moves to i + a + 1):
    # L=0 N=0: 9 steps of 0. L=0 N=2: i=0,3,6 accept 2 each -> 2.0 per step, no chain.
    # L=3 N=0: i=0 (0), i=1 (3), i=5 (3) -> 2.0, chains at 2 of 3 steps.
    # L=3 N=2: i=0 (2), i=3 (3), i=7 (2) -> 7/3, chains at 2 of 3. L=1 N=1: i=0,2,4,6,8 accept 1.
    # The tree's nodes are zeros too, so the chain shares them: at L=1 N=1 its one token is the
    # tree's node (no step adds a row); at L=3 N=2 it adds 1 row (3 tokens, 2 shared), at N=0 all 3.
    want = {(0, 0): (0.0, 0.0, 0), (0, 2): (2.0, 0.0, 0), (3, 0): (2.0, 2 / 3, 3), (3, 2): (7 / 3, 2 / 3, 1),
            (1, 1): (1.0, 0.0, 1)}
    for (length, n), (accepted, share, rows) in want.items():
        assert result.hybrid[length][n] == pytest.approx(accepted), (length, n)
        assert result.chain_share[length][n] == pytest.approx(share), (length, n)
        assert result.rows_added(length, n) == pytest.approx(rows), (length, n)
    # the per-position average counts every position: N=2 right for min(2, 9 - i), mean 17/9
    assert result.accepted[1] == pytest.approx(17 / 9)
    record = Acceptance.from_record(json.loads(json.dumps(result.as_record())))
    flat = [x for table in (record.hybrid, record.chain_share, record.chain_rows) for row in table for x in row]
    assert flat == pytest.approx([x for table in (result.hybrid, result.chain_share, result.chain_rows)
                                  for row in table for x in row], abs=1e-4)
    assert record.accepted == pytest.approx(result.accepted, abs=1e-4)


def test_monotone_smooths_noise_into_a_non_decreasing_curve():
    # a VM timed the one-token pass above the two-token one (80.4 vs 66.6 ms): noise
    # (least squares: the first four pool into their mean, 71)
    smooth = monotone({1: 80.0, 2: 66.0, 4: 70.0, 8: 68.0, 16: 90.0})
    assert smooth == pytest.approx({1: 71.0, 2: 71.0, 4: 71.0, 8: 71.0, 16: 90.0})
    assert monotone({2: 2.0, 1: 1.0, 4: 3.0}) == {1: 1.0, 2: 2.0, 4: 3.0}


def _sized_engine(tmp_path, model, heads):
    heads.measured = {"cpu": {"curves": {"3x1": CURVES[(3, 1)].as_record()}}}
    return Engine(model, heads=heads), PlanCache(tmp_path)


def size_here(engine: Engine, cache: PlanCache, compile=False, retime: bool = False) -> Plan:
    """The engine's plan with its trees sized by the planner over ``cache`` (the costs these tests
    write stand: the load does not time the curve again unless ``retime``)."""
    planner = Planner(True, cache, retime=retime)
    plan = planner.trees(engine.model, engine.heads, engine.plan, compile)
    if retime:  # as medusa.load runs it: checked on the built engine's kernels
        built = Engine(engine.model, heads=engine.heads, plan=plan)
        planner.refresh(built)
        plan = built.plan
    return plan


def _edit(cache: PlanCache, **fields) -> None:
    (key, entry), = cache.entries().items()
    cache.put(key, {**{k: v for k, v in entry.items() if k != "busy_share"}, **fields})


def test_size_here_measures_once_and_follows_this_machines_costs(tmp_path):
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    engine, cache = _sized_engine(tmp_path, model, heads)
    choice = size_here(engine, cache)
    (entry,) = cache.entries().values()
    # the calibrated shape's drafting and its shallower shapes' (sized up to their depth)
    assert sorted(map(int, entry["cost_ms"])) == list(SIZES) and set(entry["draft_ms"]) == {"1x1", "2x1", "3x1"}
    trees = choice.decision("trees")
    assert entry["seconds"] > 0 and "sized here" in trees.reason and trees.seconds == entry["seconds"]
    # a later engine reads the cache: with these (written) costs the choice follows them
    _edit(cache, cost_ms={"1": 10.0, "2": 40.0, "32": 1000.0})  # steep: no tree pays
    steep = size_here(engine, cache)
    assert (steep.eagle.nodes, steep.hybrid.nodes, steep.hybrid.chain) == (0, 0, 0)
    _edit(cache, cost_ms={str(n): 10.0 for n in SIZES}, draft_ms={"3x1": 0.0})  # flat, drafting free
    flat = size_here(engine, cache)
    assert (flat.eagle.nodes, flat.hybrid.nodes, flat.hybrid.chain) == (2, 2, 2)
    # the engine decodes with the sizes its plan holds, exactly
    ref = hf_greedy(model, PROMPT, 24)
    for plan, kinds in ((steep, (EagleProposer, EagleProposer)), (flat, (EagleProposer, Hybrid))):
        engine = Engine(model, heads=heads, plan=plan)
        eagle, hybrid = engine.proposer("eagle"), engine.proposer("hybrid")
        assert (type(eagle), type(hybrid)) == kinds
        assert eagle.size == plan.eagle
        for mode in ("eagle", "hybrid"):
            assert engine.generate(PROMPT, max_new_tokens=24, mode=mode).tokens == ref, (plan, mode)
    hybrid = engine.proposer("hybrid")  # timed passes: each step's chain as long as its match pays for
    assert hybrid.lookup.k == MATCH_TOKENS and hybrid.lookup.costs is not None
    engine.proposer_config = ProposerConfig(match_chains=False)
    assert engine.proposer("hybrid").lookup.k == 2  # else the sized chain
    engine.proposer_config = ProposerConfig(lookup_tokens=5)  # set by the user: it wins
    assert engine.proposer("hybrid").lookup.k == 5 and engine.proposer("lookup").k == 5


def test_a_chain_beside_no_tree_decodes_as_lookup(tmp_path):
    model = tiny_model("llama")
    engine, _ = _sized_engine(tmp_path, model, noisy_eagle(model))
    proposer = Engine(model, heads=engine.heads).proposer("hybrid")
    assert proposer.lookup.k == LOOKUP_TOKENS  # unsized: the calibrated tree and the default chain
    engine = Engine(model, heads=engine.heads, plan=Plan(eagle=DynamicTree(nodes=0),
                                                         hybrid=DynamicTree(nodes=0, chain=3)), proposer_config=DRAFTING)
    hybrid = engine.proposer("hybrid")
    assert hybrid.lookup.k == 3 and hybrid.heads.size.nodes == 0
    res = engine.generate(PROMPT, max_new_tokens=24, mode="hybrid")
    assert res.tokens == hf_greedy(model, PROMPT, 24) and max(res.stats.accepted) > 1  # the chain hit
    assert hybrid.heads.length == 0  # the head never ran: nothing drafted, nothing fed


def test_nothing_is_sized_without_curves_for_medusa_heads_and_compiled_cpu_engines_share_eager_timings(tmp_path):
    model = tiny_model("llama")
    cache = PlanCache(tmp_path)
    assert size_here(Engine(model, heads=noisy_eagle(model)), cache).eagle is None  # no curves
    assert size_here(Engine(model, heads=init_heads_for(model)), cache).eagle is None
    assert not cache.path.exists()
    heads = noisy_eagle(model)
    heads.measured = {"cpu": {"curves": {"3x1": CURVES[(3, 1)].as_record()}}}
    compiled = size_here(Engine(model, heads=heads, static_cache=True, compile="aot_eager"), cache, "aot_eager")
    timed = cache.path.read_text()
    eager = size_here(Engine(model, heads=heads), cache)
    # a CPU engine with compiled passes is sized from the eager passes' timings: one entry
    assert compiled.eagle is not None and eager.eagle is not None and cache.path.read_text() == timed
    assert "padded to their buckets" in compiled.decision("trees").reason
    assert "padded" not in eager.decision("trees").reason


def test_compiled_passes_are_sized_at_their_padded_buckets():
    # compiled, a pass of 3 rows runs as 4 and one of 5-8 rows as 8 (engine.PASS_BUCKETS)
    assert bucketed({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}) == {1: 10.0, 2: 11.0, 3: 13.0, 4: 13.0, 5: 17.0, 6: 17.0,
                                                              7: 17.0, 8: 17.0}
    cost = {1: 10.0, 4: 10.0, 8: 12.0}  # eager T(5..7) = 10.5, 11, 11.5 (interpolated)
    curves = {(3, 2): Acceptance(accepted=[0.5, 0.9, 1.2, 1.45, 1.65, 1.75, 1.8], draft_ms=1.0)}
    # eager, tokens/s = (1 + accepted(n)) / (T(1 + n) + 1 ms drafting): n=3 2.2/11 = 200,
    # n=4 2.45/11.5 = 213, n=5 2.65/12 = 220.8 (best), n=6 2.75/12.5 = 220, n=7 2.8/13 = 215.4
    size, _, tps = choose_dynamic(curves, cost)
    assert size.nodes == 5 and tps == pytest.approx(2.65 / 12 * 1e3)
    # compiled, n=4..7 all pay T(8): n=5 2.65/13 = 203.8, n=7 2.8/13 = 215.4 (best), n=3 200:
    # the nodes that fill the bucket come free
    size, expected, tps = choose_dynamic(curves, bucketed(cost))
    assert size.nodes == 7 and expected == pytest.approx(2.8) and tps == pytest.approx(2.8 / 13 * 1e3)


def test_drafting_is_timed_as_decoding_runs_it(monkeypatch):
    # each timed drafting follows a target pass (the head's weights leave the caches as in
    # decoding) and includes the head's update with the accepted pairs
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    events = []
    model.get_decoder().register_forward_hook(lambda *_: events.append("pass"))
    propose, update = EagleProposer.propose, EagleProposer.update

    def slow_update(self, state, outcome):
        events.append(f"update {len(outcome.tokens)}")
        time.sleep(0.05)
        return update(self, state, outcome)

    monkeypatch.setattr(EagleProposer, "propose", lambda self, state: events.append("propose") or propose(self, state))
    monkeypatch.setattr(EagleProposer, "update", slow_update)
    timed = drafting_ms(heads, model, [(2, 2)], reps=3)
    assert set(timed) == {"2x2"} and timed["2x2"] >= 50.0  # the update's time is in it
    assert events == ["pass"] + ["pass", "propose", "update 2"] * 4  # the prefill, then per round


def test_the_benchs_compiled_twin_is_sized_for_its_padded_passes(tmp_path, monkeypatch):
    import medusa

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    heads.measured = {"cpu": {"curves": {"3x1": CURVES[(3, 1)].as_record()}}}
    engine = medusa.load(target=model, heads=heads)
    twin = medusa.load(target=engine, heads=heads, compile=True)  # as the bench's MODE+compile loads it
    assert twin.passes.compiled and twin.model is engine.model
    assert "padded to their buckets" in twin.plan.decision("trees").reason
    assert "(cached" in twin.plan.decision("trees").reason  # the same timings, read from the cache
    calibrated = medusa.load(target=model, heads=heads, compile=True, autotune=False)
    assert calibrated.plan.eagle is None  # calibrated sizes


def test_a_load_times_the_curve_again_only_where_the_machine_is_faster_now(tmp_path):
    model = tiny_model("llama")
    engine, cache = _sized_engine(tmp_path, model, noisy_eagle(model))
    size_here(engine, cache)
    (key, entry), = cache.entries().items()
    real = {int(n): ms for n, ms in entry["cost_ms"].items()}
    # a curve as if timed while the machine was 50x slower: the load finds T(1) far under it,
    # times the curve again and keeps it, the longer contexts scaled by the same ratio per size
    slow = {str(n): ms * 50 for n, ms in real.items()}
    contexts = {"1024": {n: ms * 60 for n, ms in slow.items()}}  # (the tiny model's positions stop short of it)
    _edit(cache, cost_ms=slow, cost_by_context=contexts)
    plan = size_here(engine, cache, retime=True)
    (again,) = cache.entries().values()
    assert again["retimed_from"] == pytest.approx(real[1] * 50)
    assert again["cost_ms"]["1"] < 0.93 * real[1] * 50 and set(again["cost_ms"]) == set(slow)
    for c, curve in again["cost_by_context"].items():
        for n, ms in curve.items():
            assert ms == pytest.approx(contexts[c][n] * again["cost_ms"][n] / slow[n]), (c, n)
    reason = plan.decision("trees").reason
    assert dict(plan.pass_ms) == pytest.approx(monotone({int(n): ms for n, ms in again["cost_ms"].items()}))
    assert "timed again at a load" in reason and set(again["cost_by_context"]) == {"1024"}
    # a curve faster than this machine runs stays as it is, and so does any curve read with
    # retime off or autotune="cached"
    fast = {n: ms / 1000 for n, ms in again["cost_ms"].items()}
    _edit(cache, cost_ms=fast)
    size_here(engine, cache, retime=True)
    assert next(iter(cache.entries().values()))["cost_ms"] == fast
    _edit(cache, cost_ms=slow)
    size_here(engine, cache)
    Planner("cached", cache).trees(engine.model, engine.heads, engine.plan, False)
    assert next(iter(cache.entries().values()))["cost_ms"] == slow


def test_a_shallower_shape_sizes_up_to_its_depth_from_the_deeper_shapes_numbers():
    deep = Acceptance(accepted=[0.5, 0.6, 0.65, 0.7], draft_ms=8.0,
                      hybrid=[[0.0, 0.5, 0.6, 0.65, 0.7], [0.4, 0.7, 0.8, 0.85, 0.9]],
                      chain_share=[[0.0] * 5, [0.5] * 5], chain_rows=[[0.0] * 5, [1.0] * 5])
    own = Acceptance([0.55, 0.62], 3.0)
    curves = shallower({(3, 2): deep, (2, 4): own, (1, 4): Acceptance([0.5], 1.0)})
    assert set(curves) == {(3, 2), (2, 2), (1, 2), (2, 4), (1, 4)}
    one, two = curves[(1, 2)], curves[(2, 2)]
    assert one.accepted == [0.5] and two.accepted == [0.5, 0.6]  # n <= depth nodes: the deep shape's n best
    assert one.hybrid == [[0.0, 0.5], [0.4, 0.7]] and two.chain_rows == [[0.0] * 3, [1.0] * 3]
    assert curves[(3, 2)] is deep and curves[(2, 4)] is own and curves[(1, 4)].accepted == [0.5]  # calibrated ones stay
    # drafting fewer levels costs less: by hand, tokens/s with each shape's drafting timed here
    # depth 1, 1 node: 1.5 / (T(2) + 2) = 65.2; depth 2, 2 nodes: 1.6 / (T(3) + 5) = 59.3; depth 3, 2 nodes:
    # 1.6 / (T(3) + 8) = 53.3 (1 node 51.7, 3 nodes 53.2, 4 nodes 53.1)
    cost = {1: 20.0, 2: 21.0, 3: 22.0, 4: 23.0, 5: 24.0}
    timed = {shape: replace(acc, draft_ms={1: 2.0, 2: 5.0, 3: 8.0}[shape[0]]) for shape, acc in curves.items()
             if shape[1] == 2}
    size, expected, tps = choose_dynamic(timed, cost)
    assert (size.nodes, size.depth, size.topk) == (1, 1, 2) and tps == pytest.approx(1.5 / 23 * 1e3)
    size, _, tps = choose_dynamic({(3, 2): timed[(3, 2)]}, cost)  # the deep shape alone: three levels drafted
    assert (size.nodes, size.depth) == (2, 3) and tps == pytest.approx(1.6 / 30 * 1e3)


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_shallower_draft_verifies_the_very_nodes_the_deeper_one_does(nodes):
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    ref = hf_greedy(model, PROMPT, 32)
    runs = []
    for depth in (nodes, 4):
        engine = Engine(model, heads=heads, plan=Plan(eagle=DynamicTree(nodes=nodes, depth=depth, topk=2)),
                        proposer_config=DRAFTING)
        res = engine.generate(PROMPT, max_new_tokens=32, mode="eagle")
        assert res.tokens == ref
        runs.append(res.stats.accepted)
    assert runs[0] == runs[1] and max(runs[0]) > 1  # the same trees: the same tokens kept at every step
