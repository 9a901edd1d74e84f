"""Greedy speculative decoding emits exactly the target's own greedy tokens."""

import pytest
import torch
from test_sampling import chi_square_pvalue, marginal_heads, target_law
from tiny import ARCHS, DRAFTING, WINDOWED, hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.proposers.draft_model import DraftModel
from medusa.decoding.proposers.lookup import PromptLookup
from medusa.decoding.proposers.medusa import MedusaProposer
from medusa.decoding.sampling import SamplingConfig
from medusa.decoding.state import DecodeState, Proposal
from medusa.decoding.tree import chain, compile_tree
from medusa.errors import MedusaError
from medusa.models.draft import shallow_draft
from medusa.models.loader import init_heads_for

PROMPT = [5, 17, 33, 9, 41, 12]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def random_heads(model, seed):
    heads = init_heads_for(model, num_heads=3, num_layers=1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads


class OracleProposer:
    """Knows the target's greedy continuation: puts it on the first branch of a chain-plus-
    siblings tree and wrong tokens elsewhere, so every step accepts the full depth."""

    def __init__(self, continuation, depth, vocab):
        self.continuation, self.vocab = continuation, vocab
        self.tree = compile_tree(chain(depth) + [(1,)])  # a chain plus one wrong sibling

    def begin(self, state):
        self.prompt_len = len(state.tokens) - 1

    def propose(self, state):
        done = len(state.tokens) - self.prompt_len  # tokens emitted so far (root included)
        future = self.continuation[done:done + self.tree.max_depth]
        future += [3] * (self.tree.max_depth - len(future))
        wrong = (self.continuation[done] + 1) % self.vocab if done < len(self.continuation) else 4
        # layout: root, (0,), (1,), (0,0), (0,0,0) ...
        tokens = [int(state.root), future[0], wrong] + future[1:]
        return Proposal(tree=self.tree, tokens=torch.tensor(tokens))

    def update(self, state, outcome):
        pass


@pytest.mark.parametrize("arch", ARCHS)
def test_medusa_equals_baseline_equals_hf_generate(arch):
    model = tiny_model(arch)
    n = 40
    ref = hf_greedy(model, PROMPT, n)
    for heads in (init_heads_for(model, num_heads=3), random_heads(model, 0)):
        eng = Engine(model, heads=heads, tree=TREE)
        base = eng.generate(PROMPT, max_new_tokens=n, mode="baseline")
        med = eng.generate(PROMPT, max_new_tokens=n, mode="medusa")
        assert base.tokens == ref
        assert med.tokens == ref
        assert base.stats.steps == len(ref) - 1  # one target pass per token after the prefill
        assert med.stats.steps <= base.stats.steps


def test_zero_initialised_heads_get_hits_and_misses():
    # Fresh heads predict the target's own next token at every depth, which is right
    # exactly when the target repeats itself: a mix of accepted and rejected candidates.
    model = tiny_model("llama")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, proposer_config=DRAFTING)
    res = eng.generate(PROMPT, max_new_tokens=60, mode="medusa")
    assert res.tokens == hf_greedy(model, PROMPT, 60)
    assert max(res.stats.accepted) > 1 and min(res.stats.accepted) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_that_are_always_right_accept_the_whole_depth(arch):
    model = tiny_model(arch)
    n, depth = 36, 3
    ref = hf_greedy(model, PROMPT, n)
    eng = Engine(model, proposer_config=DRAFTING)
    oracle = OracleProposer(ref + [2] * 8, depth, model.config.vocab_size)
    gen = eng.stream(PROMPT, max_new_tokens=n, mode=oracle)
    chunks = list(gen)
    result = gen.result
    assert result.tokens == ref
    assert [t for c in chunks for t in c] == ref
    full = [a for a in result.stats.accepted[:-1]]
    assert all(a == depth + 1 for a in full)  # every candidate accepted, plus the bonus token


def test_stream_yields_the_generate_tokens():
    model = tiny_model("qwen2")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    gen = eng.stream(PROMPT, max_new_tokens=25)
    chunks = list(gen)
    assert all(isinstance(c, list) and c for c in chunks)
    assert [t for c in chunks for t in c] == gen.result.tokens == eng.generate(PROMPT, max_new_tokens=25).tokens


def test_eos_stops_generation():
    model = tiny_model("llama")
    ref = hf_greedy(model, PROMPT, 30)
    stop = ref[10]
    model.generation_config.eos_token_id = stop
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    for mode in ("baseline", "medusa"):
        res = eng.generate(PROMPT, max_new_tokens=30, mode=mode)
        assert res.finish_reason == "eos"
        assert res.tokens == ref[: ref.index(stop) + 1]


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_is_exact(n):
    model = tiny_model("mistral")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    res = eng.generate(PROMPT, max_new_tokens=n)
    assert len(res.tokens) == n and res.finish_reason == "length"


def test_context_window_is_respected():
    model = tiny_model("llama", max_position_embeddings=24)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    res = eng.generate(PROMPT, max_new_tokens=100)
    assert res.finish_reason == "context"
    assert len(PROMPT) + len(res.tokens) == 24 + 1  # the last token needs no KV slot
    assert res.tokens == hf_greedy(model, PROMPT, len(res.tokens))
    with pytest.raises(MedusaError, match="context window"):
        eng.generate(list(range(3, 30)), max_new_tokens=4)


def test_state_reuse_continues_like_a_fresh_prefill():
    model = tiny_model("gemma3")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    first = eng.generate(PROMPT, max_new_tokens=9)
    follow = PROMPT + first.tokens + [7, 8, 9]
    reused = eng.generate(follow, max_new_tokens=12, state=first.state)
    fresh = eng.generate(follow, max_new_tokens=12)
    assert reused.tokens == fresh.tokens
    # only the new tokens were prefilled: the first turn's last token (the root, not yet in
    # the cache) and the three added ones
    assert reused.stats.prefill_tokens == 4
    assert fresh.stats.prefill_tokens == len(follow)
    assert reused.state.cache is first.state.cache  # a turn that extends the last one continues in place


def test_branching_twice_from_one_state_equals_generate():
    # A, then B from A's state diverging early, then C from A's state again: C must not
    # trust A's longer prefix in a cache B has overwritten since
    model = tiny_model("llama")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    a = eng.generate(PROMPT, max_new_tokens=20)
    branch_b = PROMPT[:2] + [60, 61, 62]
    b = eng.generate(branch_b, max_new_tokens=20, state=a.state)
    assert b.tokens == hf_greedy(model, branch_b, 20)
    assert b.state.cache is a.state.cache  # A owned its cache: B took it without a copy
    branch_c = PROMPT + a.tokens[:5] + [70]
    c = eng.generate(branch_c, max_new_tokens=20, state=a.state)
    assert c.tokens == hf_greedy(model, branch_c, 20)
    assert c.state.cache is not a.state.cache  # A's cache was taken: C branched off a copy
    assert c.stats.prefill_tokens == len(branch_c) - 2  # only the prefix B kept was still A's
    # and every state stays usable in any order afterwards
    for prior, extra in ((b, [80]), (a, [81, 82]), (c, [83]), (b, [84, 85])):
        ids = branch_b if prior is b else branch_c if prior is c else PROMPT
        follow = ids + prior.tokens + extra
        again = eng.generate(follow, max_new_tokens=12, state=prior.state)
        assert again.tokens == hf_greedy(model, follow, 12)


def test_branching_from_one_state_with_a_static_cache():
    model = tiny_model("qwen2")
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, static_cache=True)
    a = eng.generate(PROMPT, max_new_tokens=16)
    for branch in (PROMPT[:3] + [50], PROMPT + a.tokens[:4] + [51], PROMPT[:4] + [52, 53]):
        assert eng.generate(branch, max_new_tokens=16, state=a.state).tokens == hf_greedy(model, branch, 16)


@pytest.mark.parametrize("bad, message", [
    ([], "empty"),
    (torch.zeros(2, 3, dtype=torch.long), "batch size"),
])
def test_bad_input_ids(bad, message):
    eng = Engine(tiny_model("llama"))
    with pytest.raises(MedusaError, match=message):
        eng.generate(bad, mode="baseline")


def test_tensor_and_list_inputs_agree():
    eng = Engine(tiny_model("llama"))
    a = eng.generate(PROMPT, max_new_tokens=5, mode="baseline").tokens
    b = eng.generate(torch.tensor([PROMPT]), max_new_tokens=5, mode="baseline").tokens
    assert a == b


def test_medusa_mode_without_heads_is_a_clear_error():
    eng = Engine(tiny_model("llama"))
    with pytest.raises(MedusaError, match="needs heads"):
        eng.generate(PROMPT, mode="medusa")
    with pytest.raises(MedusaError, match="unknown mode"):
        eng.generate(PROMPT, mode="nope")


class BudgetRecorder(OracleProposer):
    """The oracle, ignoring the budget (so the engine's own cuts are exercised), recording it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.budgets = []

    def propose(self, state):
        self.budgets.append(state.budget)
        return super().propose(state)


def depth2_eos(model):
    """The greedy continuation and an index j where it has a fresh token at depth 2 of a
    depth-3 oracle step (the prefill emits token 0, each step 4 more: 1-4, 5-8, ...)."""
    ref = hf_greedy(model, PROMPT, 40)
    j = next(j for j in range(6, 40, 4) if ref[j] not in ref[:j])
    return ref, j


def test_eos_inside_an_accepted_chunk_then_reuse():
    model = tiny_model("llama")
    ref, j = depth2_eos(model)
    model.generation_config.eos_token_id = ref[j]
    eng = Engine(model, proposer_config=DRAFTING)
    oracle = BudgetRecorder(ref, 3, model.config.vocab_size)
    res = eng.generate(PROMPT, max_new_tokens=40, mode=oracle)
    assert res.finish_reason == "eos" and res.tokens == ref[: j + 1]
    # the last step accepted 4 tokens but emitted 2 (EOS at depth 2): only those count
    assert res.stats.accepted == [4] * ((j - 2) // 4) + [2]
    assert sum(res.stats.accepted) == len(res.tokens) - 1  # the prefill's token is not a step's
    assert res.state.length == len(PROMPT) + j and res.state.tokens == PROMPT + ref[: j + 1]
    follow = PROMPT + res.tokens + [7, 8]
    again = eng.generate(follow, max_new_tokens=10, mode="baseline", state=res.state)
    assert again.stats.prefill_tokens == 3  # EOS (the root, never cached) and the two new ones
    full = hf_greedy(model, follow, 10)
    assert again.tokens == (full[: full.index(ref[j]) + 1] if ref[j] in full else full)


def test_length_limit_inside_an_accepted_chunk_then_reuse():
    model = tiny_model("llama")
    ref = hf_greedy(model, PROMPT, 40)
    eng = Engine(model, proposer_config=DRAFTING)
    oracle = BudgetRecorder(ref, 3, model.config.vocab_size)
    res = eng.generate(PROMPT, max_new_tokens=7, mode=oracle)
    assert res.finish_reason == "length" and res.tokens == ref[:7]
    assert res.stats.accepted == [4, 2]  # the second step's last two were cut
    assert oracle.budgets == [6, 2]  # what the proposer was told it may still emit
    follow = PROMPT + res.tokens + [9]
    again = eng.generate(follow, max_new_tokens=10, mode="baseline", state=res.state)
    assert again.stats.prefill_tokens == 2
    assert again.tokens == hf_greedy(model, follow, 10)


def test_the_budget_includes_the_context_window():
    model = tiny_model("llama", max_position_embeddings=20)
    ref = hf_greedy(model, PROMPT, 15)
    oracle = BudgetRecorder(ref + [3] * 8, 3, model.config.vocab_size)
    res = Engine(model).generate(PROMPT, max_new_tokens=100, mode=oracle)
    assert res.finish_reason == "context" and len(PROMPT) + len(res.tokens) == 21
    assert res.tokens == ref[: len(res.tokens)]
    # after the prefill the cache holds 6 positions: 20 - 6 = 14 tokens fit, then 10, 6, 2, 1
    assert oracle.budgets == [14, 10, 6, 2, 1]


def budget_state(model, tokens, budget):
    with torch.no_grad():
        hidden = model.get_decoder()(torch.tensor([tokens[:-1]])).last_hidden_state[0, -1]
    return DecodeState(cache=None, tokens=list(tokens), length=len(tokens) - 1, root=torch.tensor(tokens[-1]),
                       hidden=hidden, logits=torch.zeros(model.config.vocab_size), budget=budget)


@pytest.mark.parametrize("budget, depth", [(None, 3), (4, 3), (3, 2), (2, 1), (1, 0)])
def test_proposers_draft_no_deeper_than_the_budget(budget, depth):
    model = tiny_model("llama")
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # repeats: the lookup has a long match
    medusa = MedusaProposer(init_heads_for(model, num_heads=3), TREE, torch.device("cpu"))
    tree = medusa.propose(budget_state(model, tokens, budget)).tree
    assert tree.max_depth == depth
    assert set(tree.paths) == {p for p in TREE if len(p) <= depth}
    lookup = PromptLookup(torch.device("cpu"), num_tokens=8)
    assert lookup.propose(budget_state(model, tokens, budget)).tokens.numel() == 1 + (8 if budget is None else depth)
    draft = DraftModel(shallow_draft(model, 1), torch.device("cpu"), num_tokens=3)
    assert draft.propose(budget_state(model, tokens, budget)).tokens.numel() == 1 + depth


@pytest.mark.parametrize("arch", WINDOWED)
def test_chain_modes_with_a_dynamic_cache_past_the_sliding_window(arch):
    # chains run with transformers' own masks over our window-less cache: the window must hold
    model = tiny_model(arch, sliding_window=8)
    ref = hf_greedy(model, PROMPT, 40)
    eng = Engine(model, draft=shallow_draft(model, 1), proposer_config=DRAFTING)
    for mode in ("baseline", "lookup", "draft"):
        res = eng.generate(PROMPT, max_new_tokens=40, mode=mode)
        assert res.tokens == ref, mode
        assert max(res.stats.accepted) > 1 or mode == "baseline"


def test_hybrid_sampling_follows_the_target():
    # heads' tree plus the lookup chain, sampled: the first 3 tokens' joint law is the target's
    model = tiny_model("llama", vocab_size=16, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    sampling = SamplingConfig(temperature=0.8, top_k=8)
    eng = Engine(model, heads=marginal_heads(model, sampling, 1.0), tree=[(0,), (1,), (0, 0)])
    samples, multi = [], 0
    for seed in range(400):
        res = eng.generate([5, 7, 3, 9], max_new_tokens=3, mode="hybrid", sampling=sampling.override(seed=seed))
        samples.append(tuple(res.tokens))
        multi += max(res.stats.accepted, default=0) > 1
    assert chi_square_pvalue(samples, target_law(model, sampling, eng.eos)) > 1e-4
    assert multi > 100  # candidates were accepted, not only the target's own tokens


def test_stats_say_where_the_steps_time_went():
    # A proposer that takes 20 ms to draft and 10 ms to update: its time shows in those phases
    # and not in the verification pass's, and the phases fit in the wall clock.
    import time

    model = tiny_model("llama")
    eng = Engine(model, heads=random_heads(model, 0), proposer_config=DRAFTING)
    proposer = eng.proposer("medusa")
    steps, update = proposer.steps, proposer.update

    def slow_steps(state):  # (decoding drafts through the proposer's coroutine)
        time.sleep(0.02)
        return (yield from steps(state))

    proposer.steps = slow_steps
    proposer.update = lambda state, outcome: (time.sleep(0.01), update(state, outcome))[1]
    st = eng.generate([5, 17, 33, 9], max_new_tokens=12, mode=proposer).stats
    assert st.steps > 0
    assert st.draft_seconds >= 0.02 * st.steps and st.update_seconds >= 0.01 * st.steps
    assert st.verify_seconds > 0
    # no time counted twice (the sleeps in verify too would overrun the wall clock)
    assert st.prefill_seconds + st.draft_seconds + st.verify_seconds + st.update_seconds <= st.seconds
    assert st.as_dict()["verify_seconds"] == st.verify_seconds

