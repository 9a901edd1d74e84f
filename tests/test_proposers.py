"""The proposer protocol: every mode's proposer is a Proposer that declares its rows, whether it
samples, and what it proposes; the engine asks only that; a caller's own object is wrapped."""

import pytest
from test_batch import MODES, engine_for, run_mode
from tiny import hf_greedy

from medusa.decoding.proposers.autoregressive import Autoregressive
from medusa.decoding.state import Proposer, as_proposer
from medusa.errors import MedusaError

PROMPT = [3, 5, 7, 9, 11, 5, 7, 9]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_declares_its_rows_sampling_and_proposal(mode):
    eng = engine_for("llama", mode)
    proposer = eng.proposer(run_mode(mode))
    assert isinstance(proposer, Proposer)
    assert isinstance(proposer.max_rows, int) and 1 <= proposer.min_rows <= proposer.max_rows
    assert isinstance(proposer.greedy_only, bool)
    text = proposer.describe()
    assert text and "\n" not in text and text != type(proposer).__name__  # its own words, one line
    # what the engine compiles for it is what it declares
    assert eng.pass_sizes(proposer)[-1] >= min(proposer.max_rows, eng.max_rows or proposer.max_rows)


def test_greedy_only_is_what_the_engine_refuses_for_sampling():
    eng = engine_for("llama", "lookahead")
    assert eng.proposer("lookahead").greedy_only and not eng.proposer("lookup").greedy_only
    with pytest.raises(MedusaError, match="greedy-only"):
        eng.generate(PROMPT, max_new_tokens=4, mode="lookahead", temperature=0.7)


class Plain:
    """A caller's own proposer, not derived from Proposer: plain decoding, saying nothing of itself."""

    def __init__(self, device):
        self.inner = Autoregressive(device)
        self.calls = 0

    def begin(self, state):
        pass

    def propose(self, state):
        self.calls += 1
        return self.inner.propose(state)

    def update(self, state, outcome):
        pass


def test_a_callers_own_proposer_runs_wrapped_with_the_defaults():
    eng = engine_for("llama", "baseline")
    mine = Plain(eng.device)
    wrapped = eng.proposer(mine)
    assert isinstance(wrapped, Proposer) and wrapped.max_rows is None and wrapped.min_rows == 1
    assert wrapped.describe() == "Plain" and as_proposer(wrapped) is wrapped
    tokens = eng.generate(PROMPT, max_new_tokens=6, mode=mine).tokens
    assert tokens == hf_greedy(eng.model, PROMPT, 6)[: len(tokens)] and mine.calls >= 5
    with pytest.raises(MedusaError, match="does not say how large"):
        eng.pass_sizes(mine)


def test_an_object_that_is_no_proposer_is_one_line():
    eng = engine_for("llama", "baseline")
    with pytest.raises(MedusaError, match=r"^object is not a proposer \(no begin, propose, update\)"):
        eng.generate(PROMPT, max_new_tokens=2, mode=object())
