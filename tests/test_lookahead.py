"""Lookahead decoding: the pass layout, the n-gram pool, sizing, and greedy exactness."""

from __future__ import annotations

import pytest
import torch
from tiny import hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.decoding.proposers.hybrid import Hybrid
from medusa.decoding.proposers.lookahead import (
    POOL_KEY,
    LookaheadProposer,
    LookaheadSize,
    NgramPool,
    size_lookahead,
    window_layout,
)
from medusa.decoding.proposers.lookup import PromptLookup
from medusa.decoding.proposers.medusa import MedusaProposer
from medusa.decoding.tree import graft
from medusa.errors import MedusaError
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.loader import init_heads_for
from medusa.runtime import hf as kv

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 33, 9, 41, 12, 8, 3, 60, 70, 5, 17]


def rows(*sets: set[int], width: int) -> torch.Tensor:
    out = torch.zeros(len(sets), width, dtype=torch.bool)
    for r, cols in enumerate(sets):
        out[r, sorted(cols)] = True
    return out


def golden_proposal():
    """W=2, N=3, G=3: a pool holding three 3-grams after the root 7, a window of two levels."""
    state = Engine(tiny_model("llama")).generate([3, 4], max_new_tokens=1, mode="baseline").state
    state.tokens = [9, 8, 7]
    proposer = LookaheadProposer(torch.device("cpu"), LookaheadSize(window=2, ngram=3, guesses=3), text=False)
    proposer.begin(state)
    for gram in ((7, 1, 2), (7, 1, 3), (7, 4, 5), (8, 6, 6)):
        proposer.pool.add(gram)
    proposer.levels = [[0, 11], [20, 21]]  # level 0's column 0 is the root's place
    return proposer.propose(state)


def test_pass_layout_and_mask_golden():
    proposal = golden_proposal()
    # candidates: the newest three n-grams after 7, as a trie sharing the prefix 1
    assert proposal.tree.paths == ((0,), (1,), (0, 0), (1, 0), (1, 1))
    assert proposal.tokens.tolist() == [7, 4, 1, 5, 3, 2]
    side = proposal.side
    assert side.tokens.tolist() == [11, 20, 21]  # level 0 after the root, then level 1
    assert side.reach == 2
    tokens, depth, ancestor = side.joined(proposal.tokens, proposal.tree.depth, proposal.tree.ancestor)
    assert tokens.tolist() == [7, 4, 1, 5, 3, 2, 11, 20, 21]
    # level j, column i sits i + j after the root
    assert depth.tolist() == [0, 1, 1, 2, 2, 2, 1, 1, 2]
    expected = rows({0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 2, 5},  # the candidates' trie
                    {0, 6},  # level 0, column 1: after the root (level 0, column 0)
                    {0, 7}, {0, 6, 8},  # level 1: level 0 up to its column, then its own column
                    width=9)
    assert torch.equal(ancestor, expected)
    # the engine's additive mask: the cache for every row, then exactly this pattern
    mask = kv.tree_attention_mask(tiny_model("llama"), 3, ancestor, depth, torch.float32)
    assert mask.shape == (1, 1, 9, 12)
    assert torch.equal(mask[0, 0] == 0, torch.cat([torch.ones(9, 3, dtype=torch.bool), expected], dim=1))


def test_window_layout_three_levels():
    depth, sees = window_layout(3, 2, 1)  # W=2, three levels, after the root alone (row 0 = level 0, column 0)
    assert depth.tolist() == [1, 1, 2, 2, 3]  # (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    assert torch.equal(sees, rows({0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 1, 3, 5}, width=6))


def test_side_rows_compute_what_their_context_would():
    """A window row's logits are the target's after its own context: the cache, the root, level 0 up to its
    column and its column's earlier levels, at consecutive positions (mask and positions are right)."""
    model = tiny_model("llama")
    eng = Engine(model)
    state = eng.generate(PROMPT, max_new_tokens=1, mode="baseline").state
    cfg = LookaheadSize(window=3, ngram=3, guesses=2)
    proposer = LookaheadProposer(torch.device("cpu"), cfg, text=False)
    proposer.begin(state)
    proposer.levels = [[0, 11, 12], [20, 21, 22]]
    root = state.tokens[-1]
    outcome = eng.step(state, proposer.propose(state))
    # side rows: level 0's columns 1, 2, then level 1's columns 0, 1, 2
    for row, context in enumerate([[11], [11, 12], [20], [11, 21], [11, 12, 22]]):
        with torch.no_grad():
            plain = model(torch.tensor([PROMPT + [root] + context])).logits[0, -1]
        assert torch.allclose(outcome.side_logits[row], plain, atol=1e-4), context


def test_pool_keeps_the_newest_per_key_and_key():
    pool = NgramPool(n=3, per_key=2, max_keys=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    assert pool.lookup(1, 5) == [(4, 5), (2, 3)]  # newest first
    pool.add([1, 2, 3])  # added again: the newest
    assert pool.lookup(1, 5) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # past per_key: the oldest (4, 5) goes
    assert pool.lookup(1, 5) == [(6, 7), (2, 3)] and pool.lookup(1, 1) == [(6, 7)]
    pool.add([8, 9, 9])
    pool.add([1, 2, 3])  # key 1 is now the most recently added
    pool.add([5, 5, 5])  # past max_keys: the least recently added key (8) goes
    assert pool.lookup(8, 5) == [] and pool.lookup(5, 5) == [(5, 5)] and len(pool) == 3
    assert pool.lookup(42, 3) == []
    with pytest.raises(ValueError, match="3-grams"):
        pool.add([1, 2])


def test_pool_indexes_text_and_copies_apart():
    pool = NgramPool(n=3, per_key=4)
    pool.add_text([1, 2, 3, 1, 2, 4])
    assert pool.lookup(1, 4) == [(2, 4), (2, 3)] and pool.lookup(3, 4) == [(1, 2)]
    pool.add_text([1, 2, 3, 1, 2, 4, 9], start=6)  # only what ends after position 6: (2, 4, 9)
    assert len(pool) == 5 and pool.lookup(2, 4) == [(4, 9), (3, 1)]
    twin = pool.copy()
    twin.add([1, 7, 7])
    assert pool.lookup(1, 4) == [(2, 4), (2, 3)] and twin.lookup(1, 1) == [(7, 7)]
    with pytest.raises(MedusaError, match="n >= 2"):
        NgramPool(n=1, per_key=2)


@pytest.mark.parametrize("arch, window", [("llama", None), ("qwen2", None), ("mistral", None), ("gemma3", None),
                                          ("mistral", 8), ("qwen2", 8)])
def test_lookahead_greedy_equals_target_greedy(arch, window):
    model = tiny_model(arch, sliding_window=window)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    for config in (ProposerConfig(), ProposerConfig(lookahead_window=3, lookahead_ngram=4, lookahead_guesses=2),
                   ProposerConfig(lookahead_window=1, lookahead_ngram=3, lookahead_guesses=1, lookahead_text=False)):
        res = Engine(model, proposer_config=config).generate(PROMPT, max_new_tokens=n, mode="lookahead")
        assert res.tokens == ref, config


def test_the_window_alone_drafts_accepted_tokens():
    """With the text's n-grams kept out of the pool, every accepted draft came from the Jacobi window."""
    model = tiny_model("gemma3")
    config = ProposerConfig(lookahead_window=3, lookahead_ngram=3, lookahead_guesses=3, lookahead_text=False, check_drafting=False)
    res = Engine(model, proposer_config=config).generate(PROMPT, max_new_tokens=48, mode="lookahead")
    assert res.tokens == hf_greedy(model, PROMPT, 48)
    assert max(res.stats.accepted) > 1 and res.stats.steps < 40, res.stats.accepted
    assert len(res.state.carry[POOL_KEY]) > 0


def test_static_cache_and_row_cap_stay_exact():
    model = tiny_model("llama")
    ref = hf_greedy(model, PROMPT, 32)
    assert Engine(model, static_cache=True).generate(PROMPT, max_new_tokens=32, mode="lookahead").tokens == ref
    capped = Engine(model, plan=Plan(max_rows=4))  # the window does not fit: passes verify candidates only
    assert capped.generate(PROMPT, max_new_tokens=32, mode="lookahead").tokens == ref


def test_second_turn_keeps_the_pool_and_matches_a_fresh_generation():
    model = tiny_model("llama")
    eng = Engine(model)
    first = eng.generate(PROMPT, max_new_tokens=20, mode="lookahead")
    pool = first.state.carry[POOL_KEY]
    held = len(pool)
    prompt2 = PROMPT + first.tokens + [44, 45, 46]
    second = eng.generate(prompt2, max_new_tokens=24, mode="lookahead", state=first.state)
    fresh = eng.generate(prompt2, max_new_tokens=24, mode="lookahead")
    assert second.tokens == fresh.tokens == hf_greedy(model, prompt2, 24)
    assert second.stats.prefill_tokens == 4  # the cache was reused
    carried = second.state.carry[POOL_KEY]
    assert carried is not pool and len(pool) == held  # a copy: the first turn's state keeps its own pool
    assert set(pool.grams) <= set(carried.grams)  # what the first turn collected is still there


def test_sampling_is_refused_in_one_line():
    eng = Engine(tiny_model("llama"))
    with pytest.raises(MedusaError, match="greedy-only"):
        eng.generate(PROMPT, max_new_tokens=4, mode="lookahead", temperature=0.7)


def test_sizing_follows_the_pass_cost_curve():
    cpu = {1: 60.0, 2: 80.0, 4: 88.0, 8: 92.0, 16: 96.0, 32: 140.0}  # a 16-row pass ~1.6x a one-row one
    gpu = {1: 20.0, 2: 20.0, 4: 20.0, 8: 20.1, 16: 20.2, 32: 20.4}  # rows nearly free
    small, large = size_lookahead(cpu, "cpu"), size_lookahead(gpu, "cuda")
    assert small.rows <= 16 < large.rows
    assert (large.window, large.ngram, large.guesses) == (15, 5, 15)
    assert size_lookahead(gpu, "cuda", max_rows=32).rows <= 32
    assert size_lookahead(None, "cuda").rows > size_lookahead(None, "cpu").rows
    assert "default" in size_lookahead(None, "cpu").reason and "sized here" in small.reason
    assert size_lookahead(None, "cuda", max_rows=20).rows <= 20


def test_config_overrides_the_sized_window():
    eng = Engine(tiny_model("llama"), proposer_config=ProposerConfig(lookahead_ngram=5))
    size = eng.proposer("lookahead").size
    assert size.ngram == 5 and size.reason == "as set"
    default = size_lookahead(None, "cpu")
    assert (size.window, size.guesses) == (default.window, default.guesses)
    with pytest.raises(MedusaError, match="window >= 1, ngram >= 3"):
        Engine(tiny_model("llama"), proposer_config=ProposerConfig(lookahead_ngram=2)).proposer("lookahead")


# -- composed with hybrid: the heads' tree, the lookup chain and the pool in one pass -----------
def test_graft_shares_what_the_tree_spells_and_ranks_the_rest_after_it():
    # a tree: 4 -> (5 -> 6), 7; then sequences from the root
    paths, token_of = graft([(0,), (1,), (0, 0)], [4, 7, 5], [[4, 5, 9], [7], [8, 1], [4, 2]])
    assert paths == ((0,), (1,), (0, 0), (0, 0, 0), (2,), (2, 0), (0, 1))
    assert [token_of[p] for p in paths] == [4, 7, 5, 9, 8, 1, 2]
    assert graft([], [], [[3, 3], [3, 4]]) == (((0,), (0, 0), (0, 1)), {(0,): 3, (0, 0): 3, (0, 1): 4})


def test_hybrid_with_lookahead_lays_out_tree_chain_pool_and_window():
    model = tiny_model("llama")
    heads = init_heads_for(model, num_heads=2)
    device = torch.device("cpu")
    medusa = MedusaProposer(heads, [(0,), (1,), (0, 0)], device)
    jacobi = LookaheadProposer(device, LookaheadSize(window=2, ngram=3, guesses=2), text=False)
    hybrid = Hybrid(medusa, PromptLookup(device, num_tokens=3, max_ngram=2), device, lookahead=jacobi)
    state = Engine(model, heads=heads).generate([7, 8, 9], max_new_tokens=1, mode="baseline").state
    state.tokens, state.root = [7, 8, 9, 1, 2, 3, 1, 2], torch.tensor(2)
    hybrid.begin(state)
    for gram in ((2, 40, 41), (2, 3, 50)):
        jacobi.pool.add(gram)
    proposal = hybrid.propose(state)
    guessed = medusa.propose(state)
    index = {p: i + 1 for i, p in enumerate(proposal.tree.paths)}
    spelled_by = {tuple(proposal.tokens[index[q]].item() for q in (p[:d] for d in range(1, len(p) + 1))): p
                  for p in proposal.tree.paths}
    for i, p in enumerate(guessed.tree.paths):  # the heads' nodes keep their places
        assert proposal.tokens[index[p]] == guessed.tokens[i + 1]
    # the chain copies 3, 1, 2 after "1 2"; the pool's newest n-gram (3, 50) shares its first node
    assert {(3, 1, 2), (3, 50), (40, 41)} <= set(spelled_by)
    assert spelled_by[(3, 50)][:1] == spelled_by[(3, 1, 2)][:1]
    heads_spell = {tuple(guessed.tokens[1 + guessed.tree.paths.index(p[:d])].item() for d in range(1, len(p) + 1))
                   for p in guessed.tree.paths}
    grown = {seq[:d] for seq in heads_spell | {(3, 1, 2), (3, 50), (40, 41)} for d in range(1, len(seq) + 1)}
    assert set(spelled_by) == grown  # each distinct continuation once: nothing verified twice
    n = proposal.tree.num_nodes
    assert n == 1 + len(grown)
    assert proposal.side is not None and proposal.side.sees.shape == (3, n + 3)  # W * (N - 1) - 1 window rows
    assert hybrid.max_rows == medusa.max_rows + 3 + jacobi.max_rows - 1


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_hybrid_with_lookahead_equals_target_greedy(arch):
    model = tiny_model(arch)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    for heads in (init_heads_for(model, num_heads=2), init_eagle3_for(model, 3)):
        for config in (ProposerConfig(hybrid_lookahead=True),
                       ProposerConfig(hybrid_lookahead=True, lookahead_window=3, lookahead_ngram=4, lookahead_guesses=3)):
            engine = Engine(model, heads=heads, proposer_config=config)
            res = engine.generate(PROMPT, max_new_tokens=n, mode="hybrid")
            assert res.tokens == ref, (arch, heads.config.kind, config)
            assert POOL_KEY in res.state.carry


def test_hybrid_with_lookahead_samples_without_the_window():
    """Lookahead is greedy-only: a sampled hybrid generation runs the heads and the chain alone."""
    model = tiny_model("llama")
    engine = Engine(model, heads=init_heads_for(model, num_heads=2), proposer_config=ProposerConfig(hybrid_lookahead=True))
    proposer = engine.proposer("hybrid")
    res = engine.generate(PROMPT, max_new_tokens=12, mode=proposer, temperature=0.8, seed=1)
    assert len(res.tokens) == 12 and not proposer.jacobi and POOL_KEY not in res.state.carry
    plain = Engine(model, heads=engine.heads).generate(PROMPT, max_new_tokens=12, mode="hybrid", temperature=0.8, seed=1)
    assert res.tokens == plain.tokens  # the same draws as hybrid without lookahead


def test_bench_names_hybrid_with_lookahead():
    from medusa.bench.modes import mode_spec

    spec = mode_spec("hybrid@eagle3+lookahead+compile")
    assert (spec.base, spec.kind, spec.lookahead, spec.compiled) == ("hybrid", "eagle3", True, True)
    assert not mode_spec("hybrid").lookahead
    assert mode_spec("eagle+lookahead") is None and mode_spec("hybrid+compile+lookahead") is None


@pytest.mark.e2e
def test_embedded_model_lookahead_matches_hf(embedded):
    from test_embedded import chat_ids
    from transformers import GenerationConfig

    ids = chat_ids(embedded, "List three uses of a paperclip.")
    n = 32
    hf = embedded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=GenerationConfig(do_sample=False, max_new_tokens=n,
                                                                    eos_token_id=sorted(embedded.eos), pad_token_id=2))
    assert embedded.generate(ids, max_new_tokens=n, mode="lookahead").tokens == hf[0, len(ids):].tolist()
    import medusa  # the shipped EAGLE-3 heads with lookahead in hybrid's pass

    composed = medusa.load(target=embedded, heads="eagle3", proposers=ProposerConfig(hybrid_lookahead=True), autotune=False)
    assert composed.generate(ids, max_new_tokens=n, mode="hybrid").tokens == hf[0, len(ids):].tolist()


def test_bench_flag_parses_w_n_g():
    import argparse

    from infer.bench import lookahead_size

    assert lookahead_size("4,3,4") == (4, 3, 4)
    for bad in ("4,3", "4,2,4", "a,b,c"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lookahead"):
            lookahead_size(bad)
