"""Drawn chains calibrated at a temperature (medusa/autotune/drawn.py): the measured curve is the
chance verification keeps what the heads draw, the depth follows it and the machine's costs, and a
sampled request drafts the chain sized for the nearest calibrated temperature."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from medusa.autotune.drawn import DrawnCurve, best_depth, drawn_curve, drawn_depths, drawn_records, drawn_table
from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.decoding.proposers.eagle import DynamicTree, EagleProposer
from medusa.decoding.sampling import SamplingConfig, probabilities
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.runtime import hf as kv

COST = {1: 18.0, 2: 18.5, 4: 19.0, 8: 22.0, 16: 30.0}


def _pairs(n=3, length=12):
    return [([(5 * i + 3 * j) % 90 + 4 for j in range(10)], [(7 * i + 11 * j) % 90 + 4 for j in range(length)])
            for i in range(n)]


def test_the_curve_is_the_chance_that_verification_keeps_each_drawn_depth():
    model = tiny_model("llama", num_hidden_layers=2)
    heads = init_eagle3_for(model, 3)
    pairs = _pairs(1, 6)
    curve = drawn_curve(heads, model, pairs, temperature=0.8, depth=3)
    assert len(curve.kept) == 3 and curve.level_ms > 0
    assert all(0 < a <= b for a, b in zip(curve.kept, curve.kept[1:]))  # deeper chains keep more, never fewer
    # depth 1 by hand: sum_v min(p, q) at each position, p the target's law, q the head's
    prompt, answer = pairs[0]
    ids = prompt + answer
    seq = torch.tensor(ids)
    sampling = SamplingConfig(temperature=0.8)
    with torch.inference_mode():
        p_all = probabilities(model(input_ids=seq[None]).logits[0], sampling)
        hidden = kv.features(model, seq, heads.feature_layers)
    proposer = EagleProposer.for_heads(heads, torch.device("cpu"))
    from medusa.decoding.state import DecodeState, StepOutcome

    state = DecodeState(cache=None, tokens=ids[: len(prompt) + 1], length=len(prompt), root=seq[len(prompt)],
                        hidden=hidden[len(prompt) - 1], logits=None, prefill_hidden=hidden[: len(prompt)],
                        sampling=sampling)
    proposer.begin(state)
    betas = []
    for t in range(len(prompt), len(ids) - 1):
        q = proposer.chain_laws(state, [ids[t + 1]])[0]
        betas.append(torch.minimum(p_all[t], q).sum().item())
        proposer.update(state, StepOutcome(nodes=[0], tokens=[ids[t + 1]], hidden=hidden[t: t + 1], start=t))
        state.length, state.root = t + 1, seq[t + 1]
        state.tokens.append(ids[t + 1])
    assert curve.kept[0] == pytest.approx(sum(betas) / len(betas), rel=1e-5)


def test_the_depth_follows_what_is_kept_and_what_a_level_costs():
    deep = DrawnCurve(0.7, (0.9, 1.7, 2.4, 3.0), level_ms=0.5)
    assert best_depth(deep, COST) == 4  # cheap levels, kept drafts: the whole chain pays
    assert best_depth(DrawnCurve(1.0, (0.1, 0.11, 0.111), level_ms=3.0), COST) == 0  # nothing kept: plain
    shallow = DrawnCurve(1.0, (0.6, 0.8, 0.85, 0.86), level_ms=2.0)
    assert 1 <= best_depth(shallow, COST) < 4  # later levels keep too little for their 2 ms
    sizes = drawn_depths({"0.7": deep.as_record(), "1": shallow.as_record()}, COST)
    assert [t for t, _ in sizes] == [0.7, 1.0]
    assert sizes[0][1] == DynamicTree(nodes=4, depth=4, topk=1, chain=0)  # (no chain measured: none)


def test_a_sampled_request_drafts_the_chain_of_the_nearest_temperature():
    model = tiny_model("llama", num_hidden_layers=2)
    heads = init_eagle3_for(model, 3)
    heads.measured = {"cpu": {"drawn": {"0.7": {"kept": [0.9, 1.7, 2.4], "level_ms": 0.1},
                                        "1": {"kept": [0.9, 0.95, 0.96], "level_ms": 2.0}}}}
    assert drawn_records(heads, torch.device("cpu"), torch.float32)["0.7"]["kept"][0] == 0.9
    drawn = drawn_table(drawn_records(heads, torch.device("cpu"), torch.float32), COST)
    eng = Engine(model, heads=heads, plan=Plan(pass_ms=tuple(COST.items()), drawn=drawn))
    proposer = eng.proposer("eagle3")
    at = {t: size.depth for t, size in proposer.by_temperature}
    assert at[0.7] == 3 and at[1.0] < 3
    prompt = [(7 * i + 3) % 90 + 2 for i in range(20)]
    for temperature, depth in ((0.6, 3), (1.2, at[1.0])):
        run = eng.decoding(_request(prompt, temperature, proposer))
        for _ in run.prefill_chunks():
            pass
        run.first_chunk()
        run.begin()
        assert run.propose().tree.max_depth == depth
    import medusa

    wide = Engine(model, heads=heads, plan=eng.plan, proposer_config=medusa.ProposerConfig(draw=2))
    run = wide.decoding(_request(prompt, 0.6, wide.proposer("eagle3")))
    for _ in run.prefill_chunks():
        pass
    run.first_chunk()
    run.begin()
    drawn = run.propose()
    assert drawn.tree.max_depth == 3 and drawn.tokens.shape[0] == 1 + 2 * 3  # two candidates at each depth
    greedy = eng.generate(prompt, max_new_tokens=12, mode="eagle3").tokens
    assert greedy == eng.generate(prompt, max_new_tokens=12, mode="baseline").tokens


def _request(prompt, temperature, proposer):
    from medusa.decoding.request import make_request

    return make_request(prompt, max_new_tokens=12, mode=proposer, temperature=temperature, seed=3, ignore_eos=True)


def test_a_lookup_chain_gains_where_the_drawn_token_leaves_room_and_the_chain_matches():
    from medusa.autotune.drawn import chain_gains

    ids = [1, 2, 3, 4, 5, 6]
    target = torch.zeros(6, 8)
    target[1, 3] = 0.8  # position 1 (root 2): the next token is 3 with 0.8
    target[1, 7] = 0.2
    target[2, 4] = 0.5  # after 3: 4 with 0.5
    target[2, 6] = 0.5
    first = torch.zeros(8)
    first[3] = 0.3  # the drawn first token: 3 with 0.3
    first[7] = 0.7
    gains = chain_gains([3, 4, 5], ids, 1, target, first, chain=4)
    assert gains[0] == pytest.approx(0.5)  # max(0.8 - 0.3, 0): the residual keeps the chain's 3
    assert gains[1] == pytest.approx(0.5 + 0.5 * 0.5)  # then 4, as the answer goes on with 3
    assert gains[3] == gains[2]  # a 3-token chain cut to 4 is the same chain
    assert chain_gains([7, 4], ids, 1, target, first, chain=2) == [0.0, 0.0]  # the drawn law covers 7; 4 unknown


def test_the_hybrid_chain_beside_a_drawn_chain_is_sized_with_its_rows():
    from medusa.autotune.drawn import best_size

    rich = DrawnCurve(1.0, (0.4, 0.5), level_ms=0.5, chain=(0.5, 0.9, 1.2), chain_share=0.5)
    poor = DrawnCurve(1.0, (0.4, 0.5), level_ms=0.5, chain=(0.001, 0.002, 0.003), chain_share=1.0)
    assert best_size(rich, COST)[1] == 3  # the chain's tokens pay for its rows
    assert best_size(poor, COST)[1] == 0  # rows for nothing: no chain
    assert best_size(rich, COST, hybrid=False)[1] == 0


def test_a_sampled_hybrid_request_copies_no_more_than_its_temperature_s_chain():
    model = tiny_model("llama", num_hidden_layers=2)
    heads = init_eagle3_for(model, 3)
    chainless = {"kept": [0.9, 1.7], "level_ms": 0.1, "chain": [0.0, 0.0], "chain_share": 1.0}
    heads.measured = {"cpu": {"drawn": {"1": chainless}}}
    drawn = drawn_table(drawn_records(heads, torch.device("cpu"), torch.float32), COST)
    assert drawn[0][2].chain == 0 and drawn[0][2].depth == 2
    eng = Engine(model, heads=heads, plan=Plan(pass_ms=tuple(COST.items()), drawn=drawn))
    prompt = [5, 17, 33, 9, 41, 12] * 6  # lookup finds chains to copy
    proposer = eng.proposer("hybrid")
    run = eng.decoding(_request(prompt, 1.0, proposer))
    for _ in run.prefill_chunks():
        pass
    run.first_chunk()
    run.begin()
    for _ in range(6):
        proposal = run.propose()
        if proposal is None:
            break
        assert proposal.tokens.shape[0] <= 3  # the root and the drawn chain: no lookup rows
        run.advance(eng.step(run.state, proposal))


def _kind_heads(which, model):
    from medusa.models.block_heads import init_block_for
    from medusa.models.loader import init_heads_for

    if which == "medusa":
        return init_heads_for(model, num_heads=3)
    if which == "block":
        return init_block_for(model, 4, vocab=torch.arange(0, 96, 3))  # a draft vocabulary of a third
    return init_eagle3_for(model, 3)


def _proposed(eng, proposer, prompt, temperature):
    with torch.inference_mode():  # as the engine runs a step
        run = eng.decoding(_request(prompt, temperature, proposer))
        for _ in run.prefill_chunks():
            pass
        run.first_chunk()
        run.begin()
        return run, run.propose()


@pytest.mark.parametrize("which", ["medusa", "block", "eagle3"])
def test_the_calibrated_laws_are_the_ones_each_kind_draws_its_chain_from(which):
    # The calibration measures sum min(p, q) with chain_laws' q: it must be the law the drawn
    # proposal hands verification at every depth, or the sizes would be chosen for other drafts.
    model = tiny_model("llama", num_hidden_layers=2)
    heads = _kind_heads(which, model)
    eng = Engine(model, heads=heads, plan=Plan(pass_ms=tuple(COST.items())))
    prompt = [(7 * i + 3) % 90 + 2 for i in range(20)]
    run, drawn = _proposed(eng, eng.proposer(which), prompt, 0.8)
    assert drawn.q is not None and drawn.tree.max_depth >= 2
    laws = run.proposer.chain_laws(run.state, drawn.tokens[1:].tolist())
    ids = heads.draft_vocab
    for d, law in enumerate(laws):
        full = law if ids is None else law.new_zeros(drawn.q.shape[-1]).index_put_((ids.long(),), law)
        torch.testing.assert_close(full, drawn.q[d + 1], rtol=1e-5, atol=1e-7)
    curve = drawn_curve(heads, model, _pairs(1, 6), temperature=0.8, depth=8)
    assert 0 < curve.kept[0] <= 1 and len(curve.kept) == {"medusa": 3, "block": 4, "eagle3": 8}[which]


@pytest.mark.parametrize("which", ["medusa", "block"])
def test_static_and_block_heads_draw_as_deep_as_the_nearest_temperature_says(which):
    model = tiny_model("llama", num_hidden_layers=2)
    heads = _kind_heads(which, model)
    # the calibration's own pass costs size the static trees' drawn chains (the planner's path)
    heads.measured = {"cpu": {"cost_ms": {str(n): ms for n, ms in COST.items()},
                              "drawn": {"0.7": {"kept": [0.9, 1.7, 2.4], "level_ms": 0.1},
                                        "1": {"kept": [0.01, 0.011, 0.012], "level_ms": 2.0}}}}
    from medusa.autotune.drawn import calibrated_drawn

    drawn = calibrated_drawn(heads, torch.device("cpu"), torch.float32)
    assert [(t, e.depth, e.nodes) for t, e, _ in drawn] == [(0.7, 3, 3), (1.0, 1, 0)]  # 0 nodes at T=1: plain
    costly = calibrated_drawn(heads, torch.device("cpu"), torch.float32, {1: 10.0, 2: 30.0, 4: 60.0})
    assert [e.nodes for _, e, _ in costly] == [0, 0]  # this machine's costs (the kernel pick's) come first
    if which == "block":  # a greedy block sized to draft nothing still drafts sampled requests
        heads.dynamic = {"cpu": DynamicTree(nodes=0, depth=1, topk=1).as_dict()}
    eng = Engine(model, heads=heads, plan=Plan(pass_ms=tuple(COST.items()), drawn=drawn))
    proposer = eng.proposer(which)
    assert proposer.max_rows >= 4
    prompt = [(7 * i + 3) % 90 + 2 for i in range(20)]
    assert _proposed(eng, proposer, prompt, 0.6)[1].tree.max_depth == 3
    plain = _proposed(eng, proposer, prompt, 1.2)[1]
    assert plain.tokens.shape[0] == 1 and plain.q is None  # plain decoding pays more there
    sampled = eng.generate(prompt, max_new_tokens=12, mode=which, temperature=0.6, seed=5, ignore_eos=True)
    assert len(sampled.tokens) == 12 and sampled.tokens == eng.generate(
        prompt, max_new_tokens=12, mode=which, temperature=0.6, seed=5, ignore_eos=True).tokens  # the seed's sample
    greedy = eng.generate(prompt, max_new_tokens=12, mode=which).tokens
    assert greedy == eng.generate(prompt, max_new_tokens=12, mode="baseline").tokens


def test_the_siblings_chance_is_the_one_verification_keeps_them_with():
    # sibling_keeps predicts how often verify_sampled keeps one of k siblings drawn without
    # replacement (draw()); both are run here, the verification thousands of times
    from medusa.autotune.drawn import sibling_keeps
    from medusa.decoding.proposers.drawn import draw, drawn_proposal
    from medusa.decoding.verify import verify_sampled

    torch.manual_seed(0)
    sampling = SamplingConfig(temperature=1.0)
    target_logits, head_logits = torch.randn(12) * 1.5, torch.randn(12) * 1.5
    p, q = probabilities(target_logits, sampling), probabilities(head_logits, sampling)
    predicted = sibling_keeps(p, q, 3, torch.Generator().manual_seed(1), draws=3000)
    assert predicted[0] == pytest.approx(torch.minimum(p, q).sum().item())
    assert predicted[0] < predicted[1] < predicted[2] <= 1.0  # each sibling keeps something more
    generator = torch.Generator().manual_seed(2)
    for width in (2, 3):
        kept, trials = 0, 3000
        for _ in range(trials):
            proposal = drawn_proposal(torch.tensor(0), [draw(head_logits, sampling, width, generator, None, 12)])
            logits = target_logits.expand(proposal.tokens.shape[0], 12)
            kept += verify_sampled(proposal.tree, proposal.tokens, logits, proposal.q, sampling, generator).length >= 1
        assert kept / trials == pytest.approx(predicted[width - 1], abs=0.03)


def test_the_plan_widens_a_level_only_where_its_siblings_pay_for_their_rows():
    from medusa.autotune.drawn import best_size, describe_drawn

    cheap = {1: 18.0, 2: 18.2, 4: 18.6, 8: 19.4, 16: 21.0}
    wide = DrawnCurve(0.7, (0.4, 0.55, 0.6), level_ms=0.2, wide=((0.7, 1.0, 1.1), (0.85, 1.25, 1.4)))
    assert best_size(wide, cheap, hybrid=False) == (3, 0, 3)  # siblings keep much more, rows cost little
    steep = {1: 18.0, 2: 20.0, 4: 24.0, 8: 32.0, 16: 48.0}
    depth, _, width = best_size(wide, steep, hybrid=False)
    assert depth * width < 9  # rows at 2 ms: fewer siblings or levels
    flat = DrawnCurve(1.0, (0.4, 0.55, 0.6), level_ms=0.2, wide=((0.41, 0.56, 0.61), (0.42, 0.57, 0.62)))
    assert best_size(flat, cheap, hybrid=False)[2] == 1  # siblings that keep nothing more: a chain
    assert DrawnCurve.from_record(0.7, wide.as_record()) == wide
    sizes = drawn_depths({"0.7": wide.as_record()}, cheap)
    assert sizes[0][1] == DynamicTree(nodes=9, depth=3, topk=3, chain=0)
    assert "eagle a 3-deep drawn tree, 3 a depth" in describe_drawn(drawn_table({"0.7": wide.as_record()}, cheap))


@pytest.mark.parametrize("which", ["medusa", "block", "eagle3"])
def test_each_kind_draws_the_siblings_a_depth_the_plan_sized(which):
    model = tiny_model("llama", num_hidden_layers=2)
    heads = _kind_heads(which, model)
    cheap = {1: 18.0, 2: 18.2, 4: 18.6, 8: 19.4, 16: 21.0}
    record = {"kept": [0.4, 0.55], "level_ms": 0.1, "wide": {"2": [0.7, 1.0], "3": [0.72, 1.02]}}
    heads.measured = {"cpu": {"cost_ms": {str(n): ms for n, ms in cheap.items()}, "drawn": {"0.7": record}}}
    drawn = drawn_table(drawn_records(heads, torch.device("cpu"), torch.float32), cheap)
    assert (drawn[0][1].topk, drawn[0][1].nodes) == (2, 4)  # the third sibling keeps too little
    eng = Engine(model, heads=heads, plan=Plan(pass_ms=tuple(cheap.items()), drawn=drawn))
    prompt = [(7 * i + 3) % 90 + 2 for i in range(20)]
    proposal = _proposed(eng, eng.proposer(which), prompt, 0.7)[1]
    assert proposal.tree.max_depth == 2 and proposal.tokens.shape[0] == 1 + 2 * 2  # two drawn a depth
    import medusa

    chain = Engine(model, heads=heads, plan=eng.plan, proposer_config=medusa.ProposerConfig(draw=1))
    proposal = _proposed(chain, chain.proposer(which), prompt, 0.7)[1]
    assert proposal.tree.max_depth == 2 and proposal.is_chain  # draw=1: one a depth, as deep
    first = eng.generate(prompt, max_new_tokens=12, mode=which, temperature=0.7, seed=4, ignore_eos=True).tokens
    assert first == eng.generate(prompt, max_new_tokens=12, mode=which, temperature=0.7, seed=4,
                                 ignore_eos=True).tokens


def test_the_curve_measures_wider_levels_keeping_at_least_the_chain():
    model = tiny_model("llama", num_hidden_layers=2)
    heads = init_eagle3_for(model, 3)
    curve = drawn_curve(heads, model, _pairs(1, 6), temperature=0.8, depth=3, width=3)
    assert len(curve.wide) == 2 and all(len(kept) == 3 for kept in curve.wide)
    for narrow, wider in zip(curve.by_width(), curve.by_width()[1:]):
        assert all(a <= b + 1e-9 for a, b in zip(narrow[1], wider[1]))  # a sibling more never keeps less
    assert curve.wide[0][0] > curve.kept[0]
