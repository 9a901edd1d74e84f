"""Prompt lookup: n-gram proposals from the text so far, verified by the same engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny import DRAFTING, hf_greedy, tiny_model
from tiny_heads import random_heads

from medusa.decoding.engine import Engine
from medusa.decoding.payoff import Curves
from medusa.decoding.proposers.factory import LOOKUP_TOKENS, ProposerConfig
from medusa.decoding.proposers.hybrid import Hybrid
from medusa.decoding.proposers.lookup import MatchChains, PromptLookup, match_bucket, match_length
from medusa.decoding.proposers.medusa import MedusaProposer
from medusa.errors import MedusaError
from medusa.models.loader import init_heads_for

# A prompt that repeats itself, as code edits and summaries do.
PROMPT = [5, 17, 33, 9, 41, 12, 5, 17, 33, 9, 41, 12, 5, 17]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lookup_greedy_equals_target_greedy(arch):
    model = tiny_model(arch)
    n = 48
    ref = hf_greedy(model, PROMPT, n)
    for k, ngram in ((8, 3), (2, 1)):
        eng = Engine(model, proposer_config=ProposerConfig(lookup_tokens=k, lookup_ngram=ngram, check_drafting=False))
        res = eng.generate(PROMPT, max_new_tokens=n, mode="lookup")
        assert res.tokens == ref
        # the tiny model's greedy text repeats, so copying from it pays off at times
        assert max(res.stats.accepted) > 1 and res.stats.steps < n - 1, res.stats.accepted


def state_with(tokens: list[int]):
    """A real decode state whose token list is then replaced by ``tokens`` (lookup reads only those)."""
    state = Engine(tiny_model("llama")).generate([3, 4], max_new_tokens=1, mode="baseline").state
    state.tokens = list(tokens)
    state.root = torch.tensor(tokens[-1])
    return state


@pytest.mark.parametrize("tokens, max_ngram, expected", [
    ([1, 2, 3, 4, 9, 9, 1, 2, 3], 3, [4, 9, 9]),  # the 3-gram (1, 2, 3) was followed by 4, 9, 9
    ([1, 2, 5, 1, 2, 6, 7, 1, 2], 2, [6, 7, 1]),  # the latest occurrence wins
    ([4, 1, 2, 8, 5, 1, 2, 7, 4, 1, 2], 3, [8, 5, 1]),  # a longer match beats a later, shorter one
    ([4, 1, 2, 8, 5, 1, 2, 7, 4, 1, 2], 2, [7, 4, 1]),  # ... unless longer n-grams are not looked up
    ([6, 7, 8, 9], 3, []),  # no earlier occurrence of any suffix: the root alone
    ([6, 1, 1], 3, [1, 1, 1]),  # a match running into the suffix continues with its period (1)
    ([6, 1, 2, 1, 2], 3, [1, 2, 1]),  # ... here period 2
    ([1, 2, 3, 7, 1, 2], 3, [3, 7, 1]),  # the text after an earlier match runs out: fewer than 3 is fine too
])
def test_lookup_proposes_what_followed_the_latest_longest_match(tokens, max_ngram, expected):
    lookup = PromptLookup(torch.device("cpu"), num_tokens=3, max_ngram=max_ngram)
    state = state_with(tokens)
    lookup.begin(state)
    proposal = lookup.propose(state)
    assert proposal.tokens.tolist() == [tokens[-1]] + expected
    assert proposal.is_chain and proposal.tree.num_nodes == 1 + len(expected)
    assert proposal.tree.max_depth == len(expected)


def test_lookup_index_follows_a_growing_sequence():
    lookup = PromptLookup(torch.device("cpu"), num_tokens=4, max_ngram=2)
    state = state_with([1, 2, 3, 4])
    lookup.begin(state)
    assert lookup.propose(state).tokens.tolist() == [4]
    state.tokens += [1, 2]  # (1, 2) now repeats: propose what followed it before
    assert lookup.propose(state).tokens.tolist() == [2, 3, 4, 1, 2]
    state.tokens += [7, 1, 2]  # a newer occurrence of (1, 2), followed by 7
    assert lookup.propose(state).tokens.tolist() == [2, 7, 1, 2, 7]  # 7 1 2 repeats up to the end


def test_bad_lookup_settings_are_clear_errors():
    with pytest.raises(MedusaError, match="min_ngram"):
        PromptLookup(torch.device("cpu"), num_tokens=4, max_ngram=0)
    with pytest.raises(MedusaError, match="num_tokens"):
        PromptLookup(torch.device("cpu"), num_tokens=0)


# -- hybrid: the heads' tree and the lookup chain in one pass --------------------------------
HEADS_TREE = [(0,), (1,), (0, 0), (1, 0)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hybrid_greedy_equals_target_greedy(arch):
    model = tiny_model(arch)
    n = 48
    ref = hf_greedy(model, PROMPT, n)
    for heads in (init_heads_for(model, num_heads=2), random_heads(model, num_heads=2, seed=1, scale=0.3)):
        eng = Engine(model, heads=heads, tree=HEADS_TREE)
        res = eng.generate(PROMPT, max_new_tokens=n, mode="hybrid")
        assert res.tokens == ref


def test_hybrid_takes_the_lookup_chain_where_it_is_longer():
    model = tiny_model("llama")  # its greedy text ends in a long run of one token
    eng = Engine(model, heads=init_heads_for(model, num_heads=2), tree=HEADS_TREE, proposer_config=DRAFTING)
    res = eng.generate(PROMPT, max_new_tokens=48, mode="hybrid")
    # The heads reach depth 2, so a step that emits more than 3 tokens took the chain.
    assert max(res.stats.accepted) > 3, res.stats.accepted
    heads_only = eng.generate(PROMPT, max_new_tokens=48, mode="medusa")
    assert res.tokens == heads_only.tokens and res.stats.steps < heads_only.stats.steps


def test_hybrid_lays_out_the_heads_tree_and_the_chain_side_by_side():
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2, seed=2, scale=0.3)
    device = torch.device("cpu")
    medusa = MedusaProposer(heads, HEADS_TREE, device)
    lookup = PromptLookup(device, num_tokens=3, max_ngram=2)
    hybrid = Hybrid(medusa, lookup, device)
    state = Engine(model, heads=heads).generate([7, 8, 9], max_new_tokens=1, mode="baseline").state
    state.tokens, state.root = [7, 8, 9, 1, 2, 3, 1, 2], torch.tensor(2)  # lookup reads only these
    hybrid.begin(state)
    proposal = hybrid.propose(state)
    guessed, copied = medusa.propose(state), lookup.propose(state)
    assert copied.tokens.numel() > 1  # (1, 2) occurred before: the chain is there
    tree = proposal.tree
    assert tree.num_nodes == guessed.tree.num_nodes + copied.tokens.numel() - 1
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    for i, p in enumerate(guessed.tree.paths):  # every head candidate keeps its path and token
        assert proposal.tokens[index[p]] == guessed.tokens[i + 1]
    chain_nodes = [index[p] for p in tree.paths if p[0] == 2]  # rank 2 at depth 1: past the heads' ranks 0, 1
    assert proposal.tokens[chain_nodes].tolist() == copied.tokens[1:].tolist()
    assert tree.parent[chain_nodes].tolist() == [0] + chain_nodes[:-1]  # a chain hanging off the root
    assert proposal.tokens[0] == state.root


def test_hybrid_without_a_match_is_the_heads_tree():
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2, seed=3, scale=0.3)
    device = torch.device("cpu")
    hybrid = Hybrid(MedusaProposer(heads, HEADS_TREE, device), PromptLookup(device), device)
    state = Engine(model, heads=heads).generate([7, 8, 9, 10], max_new_tokens=1, mode="baseline").state
    hybrid.begin(state)
    assert hybrid.propose(state).tree.paths == tuple(sorted(HEADS_TREE, key=lambda p: (len(p), p)))


def test_hybrid_chain_shares_the_nodes_the_heads_drafted_too():
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2, seed=2, scale=0.3)
    device = torch.device("cpu")
    medusa = MedusaProposer(heads, HEADS_TREE, device)
    hybrid = Hybrid(medusa, PromptLookup(device, num_tokens=3, max_ngram=2), device)
    state = Engine(model, heads=heads).generate([7, 8, 9], max_new_tokens=1, mode="baseline").state
    state.tokens, state.root = [7, 8, 9, 1, 2], torch.tensor(2)
    guessed = medusa.propose(state)
    drafted = dict(zip(guessed.tree.paths, guessed.tokens[1:].tolist()))
    # the text copies the heads' first guess, then a token the heads did not draft below it
    other = next(t for t in range(40, 60) if t != drafted[(0, 0)])
    state.tokens = [7, 8, 9, 1, 2, drafted[(0,)], other, 1, 2]
    hybrid.begin(state)
    proposal = hybrid.propose(state)
    tree = proposal.tree
    assert tree.num_nodes == guessed.tree.num_nodes + 2  # 3 chain tokens, the first one shared
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    for p, token in drafted.items():
        assert proposal.tokens[index[p]] == token
    # the chain's rest hangs off the heads' node (0,), beside its child (0, 0)
    assert proposal.tokens[[index[(0, 1)], index[(0, 1, 0)]]].tolist() == [other, 1]
    assert tree.parent[index[(0, 1)]] == index[(0,)]


def test_hybrid_layout_attaches_the_chain_below_the_deepest_shared_node():
    from medusa.decoding.proposers.hybrid import _hybrid_layout
    from medusa.decoding.tree import spelled

    base = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    tokens = [5, 6, 7, 8, 9]  # per path above
    assert spelled(base, tokens, [5, 7, 4, 4]) == [(0,), (0, 0)]
    assert spelled(base, tokens, [5, 8]) == [(0,), (0, 1)]
    assert spelled(base, tokens, [6, 7]) == [(1,)]
    assert spelled(base, tokens, [7, 5]) == []
    tree, base_nodes, chain_nodes, is_chain = _hybrid_layout(base, 2, (0, 0))
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (0, 0, 1, 0))
    assert base_nodes.tolist() == [0, 1, 2, 3, 4, 5] and chain_nodes.tolist() == [6, 7]
    assert tree.parent[6] == 3 and tree.parent[7] == 6 and not is_chain
    # a chain continuing a one-path tree is a chain: plain causal attention verifies it
    assert _hybrid_layout(((0,), (0, 0)), 2, (0, 0))[3]
    assert not _hybrid_layout(((0,), (0, 0)), 2, (0,))[3]


def test_match_length_counts_the_tokens_the_text_repeats_before_the_copy():
    tokens = [7, 1, 2, 3, 4, 9, 8, 1, 2, 3]
    assert match_length(tokens, 4) == 3  # 1 2 3 before position 4, as the text ends; 7 then differs from 8
    assert match_length(tokens, 4, most=2) == 2
    assert match_length([5, 1, 2, 6, 5, 1, 2], 3) == 3  # back to the text's start
    assert match_length([1, 2, 3], 1) == 0  # 1 is not the last token
    assert [match_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 40)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6]


# a CPU-like pass: the rows beyond the first cheap at a short context, dearer after 4k tokens
CHEAP = ((1, 10.0), (2, 10.3), (4, 10.9), (8, 12.1), (16, 14.5), (32, 19.3))
STEEP = ((1, 20.0), (2, 24.0), (4, 32.0), (8, 48.0), (16, 80.0), (32, 144.0))


def test_match_chains_lengthen_where_copies_were_kept_and_not_where_they_were_not():
    chains = MatchChains(Curves(CHEAP))
    before = chains.chain(6, 300, 1, 16)
    assert 1 <= before < 16
    for _ in range(12):  # after long matches the whole copy was the target's
        chains.pending = (6, list(range(before)))
        chains.record(list(range(before)) + [99])
        chains.pending = (1, [5, 6, 7])  # after one matching token, nothing was
        chains.record([8, 9])
    assert chains.chain(6, 300, 1, 16) == 16  # kept copies, cheap rows: as long as allowed
    assert chains.chain(6, 300, 1, 5) == 5
    assert chains.chain(1, 300, 1, 16) <= 2  # never kept: (nearly) the shortest chain, rows being cheap
    assert chains.chain(6, 300, 1, 0) == 0  # no room: none
    # the same acceptance where each row costs a fifth of a pass: shorter chains
    steep = MatchChains(Curves(CHEAP, by_length=((4096, STEEP),)))
    steep.counts = [list(c) for c in chains.counts]
    assert steep.chain(6, 300, 1, 16) == 16 and steep.chain(6, 5000, 1, 16) < 16
    assert steep.chain(1, 5000, 1, 16) == 1


def test_match_chains_count_only_what_was_tried():
    chains = MatchChains(Curves(CHEAP))
    chains.record([1, 2])  # nothing in flight: nothing counted
    assert chains.counts[4] == [0, 0, 0, 0]
    chains.pending = (4, [1, 2, 3, 4])
    chains.record([1, 2, 7])  # two kept: the third was tried and missed, the fourth never tried
    assert chains.counts[4] == [1, 1, 1, 2] and chains.pending is None


def repeating_engine(model, **config):
    """An engine whose plan times passes (rows nearly free), as a CPU's measured plan does."""
    eng = Engine(model, proposer_config=ProposerConfig(check_drafting=False, **config))
    eng.plan = replace(eng.plan, pass_ms=CHEAP)
    return eng


def test_lookup_chains_sized_per_match_keep_the_target_greedy_and_outgrow_the_fixed_chain():
    model = tiny_model("llama")  # its greedy text ends in a long run of one token
    n = 64
    ref = hf_greedy(model, PROMPT, n)
    fixed = repeating_engine(model, match_chains=False).generate(PROMPT, max_new_tokens=n, mode="lookup")
    matched_engine = repeating_engine(model)
    matched = matched_engine.generate(PROMPT, max_new_tokens=n, mode="lookup")
    assert fixed.tokens == ref and matched.tokens == ref
    assert max(fixed.stats.accepted) <= LOOKUP_TOKENS + 1
    assert max(matched.stats.accepted) > LOOKUP_TOKENS + 1, matched.stats.accepted  # a copy past 8 tokens
    set_length = repeating_engine(model, lookup_tokens=3).generate(PROMPT, max_new_tokens=n, mode="lookup")
    assert set_length.tokens == ref and max(set_length.stats.accepted) <= 4  # a set length is kept
    untimed = Engine(model, proposer_config=ProposerConfig(check_drafting=False))  # no pass costs: fixed
    assert max(untimed.generate(PROMPT, max_new_tokens=n, mode="lookup").stats.accepted) <= LOOKUP_TOKENS + 1
    assert "sized per match" in matched_engine.proposer("lookup").describe()


def test_hybrid_chains_sized_per_match_keep_the_target_greedy():
    model = tiny_model("llama")
    n = 64
    ref = hf_greedy(model, PROMPT, n)
    eng = Engine(model, heads=random_heads(model, num_heads=2, seed=1, scale=0.3), tree=HEADS_TREE,
                 proposer_config=ProposerConfig(check_drafting=False))
    eng.plan = replace(eng.plan, pass_ms=CHEAP)
    res = eng.generate(PROMPT, max_new_tokens=n, mode="hybrid")
    assert res.tokens == ref
    assert max(res.stats.accepted) > LOOKUP_TOKENS + 1, res.stats.accepted
