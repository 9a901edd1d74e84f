"""Greedy chains of several sequences accepted at once (medusa/decoding/run.py: accept_chains)
give what :func:`accept` gives each one alone: the tokens, the kept nodes, the new root, and the
cache cut to the same length."""

from __future__ import annotations

import copy

import pytest
import torch

from medusa.decoding.batch import _accepted_chains
from medusa.decoding.run import accept, accept_chains, greedy_chain
from medusa.decoding.sampling import SamplingConfig
from medusa.decoding.state import DecodeState, Proposal
from medusa.decoding.tree import chain_tree, compile_tree
from medusa.runtime import hf as kv

V, H = 11, 4


def state_after(tokens: list[int], cached: int, sampling: SamplingConfig | None = None) -> DecodeState:
    cache = kv.new_cache()
    for layer in range(2):
        cache.update(torch.randn(1, 1, cached, 3), torch.randn(1, 1, cached, 3), layer)
    return DecodeState(cache=cache, tokens=list(tokens), length=len(tokens) - 1, root=torch.tensor(tokens[-1]),
                       hidden=torch.zeros(H), logits=torch.zeros(V), sampling=sampling or SamplingConfig())


def chain_step(seed: int, k: int, keep: int):
    """A chain of ``k`` drafted tokens whose first ``keep`` match the target's argmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, V, generator=g)
    argmax = logits.argmax(-1)
    drafts = [int(argmax[i]) if i < keep else (int(argmax[i]) + 1) % V for i in range(k)]
    tokens = torch.tensor([seed % V] + drafts)
    state = state_after([1, 2, 3, seed % V], cached=3 + k + 1)  # the pass appended the chain's k + 1 rows
    proposal = Proposal(tree=chain_tree({}, k, torch.device("cpu")), tokens=tokens, is_chain=True)
    return state, proposal, (logits, torch.randn(k + 1, H, generator=g), None)


@pytest.mark.parametrize("keeps", [(0, 2, 4), (4, 0, 1), (1, 1, 1)])
def test_chains_accepted_at_once_match_accept_one_by_one(keeps):
    steps = [chain_step(seed, 4 if i != 2 else 1, min(keep, 4 if i != 2 else 1)) for i, (seed, keep) in
             enumerate(zip((5, 6, 7), keeps))]
    alone = [copy.deepcopy(s) for s in steps]
    together = accept_chains(steps)
    for (state, _, _), got, (state1, proposal1, verified1) in zip(steps, together, alone):
        want = accept(state1, proposal1, *verified1)
        assert got.tokens == want.tokens and got.nodes == want.nodes
        assert state.length == state1.length and state.tokens == state1.tokens
        assert int(state.root) == int(state1.root)
        assert torch.equal(state.hidden, state1.hidden)
        assert state.cache.get_seq_length() == state1.cache.get_seq_length() == state.length


def test_only_plain_greedy_chains_are_accepted_at_once():
    state, proposal, verified = chain_step(3, 3, 1)
    assert greedy_chain(state, proposal)
    sampled = copy.deepcopy(state)
    sampled.sampling = SamplingConfig(temperature=0.7)
    tree = Proposal(tree=compile_tree([(0,), (1,)]), tokens=torch.tensor([1, 2, 3]))
    assert not greedy_chain(sampled, proposal) and not greedy_chain(state, tree)


def test_a_batch_leaves_other_proposals_to_accept():
    class Run:
        def __init__(self, state):
            self.state = state

    a, b, c = chain_step(1, 2, 1), chain_step(2, 2, 2), chain_step(3, 2, 0)
    c[0].sampling = SamplingConfig(temperature=0.7)  # sampled: left as the pass's outputs
    failed = RuntimeError("its own pass")
    out = _accepted_chains([Run(a[0]), Run(b[0]), Run(c[0]), Run(a[0])], [a[1], b[1], c[1], a[1]],
                           [a[2], b[2], c[2], failed])
    assert out[0].tokens and out[1].tokens  # accepted
    assert out[2] is c[2] and out[3] is failed
