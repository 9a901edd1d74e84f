"""Greedy speculative decoding emits exactly the target's own greedy tokens."""

import pytest
import torch
from tiny import ARCHS, hf_greedy, tiny_model

from medusa.engine import Engine
from medusa.errors import MedusaError
from medusa.heads import init_heads_for
from medusa.proposers import Proposal
from medusa.tree import chain, compile_tree

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
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    res = eng.generate(PROMPT, max_new_tokens=60, mode="medusa")
    assert res.tokens == hf_greedy(model, PROMPT, 60)
    assert max(res.stats.accepted) > 1 and min(res.stats.accepted) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_that_are_always_right_accept_the_whole_depth(arch):
    model = tiny_model(arch)
    n, depth = 36, 3
    ref = hf_greedy(model, PROMPT, n)
    eng = Engine(model)
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
    # only the new tokens were prefilled: the reused cache already held the first turn
    assert first.state.length >= len(PROMPT) + len(first.tokens) - 1


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
