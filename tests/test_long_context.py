"""Long contexts: trees and chains sized per context length, and every mode exact past 2k tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_eagle import noisy_eagle
from test_sizing import CURVES
from tiny import DRAFTING, hf_greedy, tiny_model

from medusa.autotune.sizing import LENGTHS, PREFIX, cost_at, sizes_from
from medusa.decoding.engine import Engine
from medusa.decoding.plan import Plan
from medusa.decoding.proposers.eagle import DynamicTree, EagleProposer
from medusa.decoding.proposers.hybrid import Hybrid
from medusa.decoding.state import DecodeState
from medusa.models.block_heads import init_block_for
from medusa.models.draft import shallow_draft
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.loader import init_heads_for

ROWS = (1, 2, 3, 4, 10)
# the pass cost at 256, 1024 and 2048 cached tokens: the rows beyond the first cost more the
# longer the context (one row's cost stays: the weights dominate it)
ENTRY = {"cost_ms": dict(zip(map(str, ROWS), (10.0, 10.0, 10.0, 20.0, 50.0))),
         "cost_by_context": {"1024": dict(zip(map(str, ROWS), (10.0, 13.0, 18.0, 30.0, 70.0))),
                             "2048": dict(zip(map(str, ROWS), (10.0, 20.0, 30.0, 40.0, 100.0)))},
         "draft_ms": {"3x1": 1.0}}


def test_the_cost_curve_between_and_beyond_the_timed_contexts():
    assert cost_at(ENTRY, PREFIX)[2] == 10.0 and cost_at(ENTRY, 100)[2] == 10.0  # below the first: as there
    assert cost_at(ENTRY, 512)[3] == pytest.approx(10.0 + 8.0 / 3)  # a third of the way to 1024
    assert cost_at(ENTRY, 1024)[4] == 30.0 and cost_at(ENTRY, 1536)[10] == 85.0
    assert cost_at(ENTRY, 4096)[2] == pytest.approx(34.0)  # 2048's plus twice the last segment's growth
    # one context timed only (a model with few positions): that curve at every length
    assert cost_at({"cost_ms": ENTRY["cost_ms"]}, 4096) == cost_at(ENTRY, PREFIX)


def test_trees_and_chains_shrink_as_the_context_grows():
    # by hand from CURVES (one 3x1 shape) and 1 ms of drafting, tokens/s = (1 + accepted) / ms * 1e3:
    # mode eagle at 256: n=2 1.6/11 (145) beats n=1 1.5/11 and plain 100; at 512 (T(2) 11,
    # T(3) 12.67) n=1 1.5/12 = 125 beats n=2 1.6/13.67 = 117; at 2048 n=1 is 1.5/21: plain wins
    choice = sizes_from(ENTRY, CURVES, max_rows=None, compiled=False)
    assert (choice.eagle.nodes, choice.eagle.depth, choice.eagle.topk) == (2, 3, 1)
    assert choice.eagle.longer == ((384, DynamicTree(nodes=1, depth=3, topk=1)),
                                   (1536, DynamicTree(nodes=0, depth=3, topk=1)))
    # mode hybrid at 256: no tree, a 2-token chain (half the steps add its rows: 160 tokens/s);
    # at 1024 chain 2 costs 0.5 T(1) + 0.5 T(3) = 14 (114), chain 1 11.5 (121.7): 1 token from 768;
    # at 2048 chain 1 is 1.4/15 = 93, below plain decoding's 100: no chain from 1536
    assert (choice.hybrid.nodes, choice.hybrid.chain) == (0, 2)
    assert [(start, size.nodes, size.chain) for start, size in choice.hybrid.longer] == [(768, 0, 1), (1536, 0, 0)]
    assert choice.hybrid.at(767).chain == 2 and choice.hybrid.at(768).chain == 1 and choice.hybrid.at(5000).chain == 0
    assert "from 384 tokens 1 nodes" in choice.reason and "after 2048 tokens T(1)=10.0 ms" in choice.reason
    # a size never grows with the context, whatever the costs say there (a proposer drafts one shape)
    cheap = {**ENTRY, "cost_by_context": {"1024": dict(zip(map(str, ROWS), (10.0, 10.0, 10.0, 10.0, 10.0)))}}
    grown = sizes_from(cheap, CURVES, max_rows=None, compiled=False)
    assert all(size.nodes <= grown.eagle.nodes for size in grown.eagle.sizes)
    assert all(size.chain <= grown.hybrid.chain for size in grown.hybrid.sizes)
    # timings from before contexts were timed: one size for every length
    old = sizes_from({k: v for k, v in ENTRY.items() if k != "cost_by_context"}, CURVES, None, False)
    assert old.eagle.longer == () and old.hybrid.longer == ()
    # the pass curve at each sized length goes to the plan (a lone sequence's check of what its rows cost)
    assert choice.cost_by_length == {n: cost_at(ENTRY, n) for n in LENGTHS} and old.cost_by_length == {}
    assert choice.cost_by_length[2048][1] == 10.0 and choice.cost_by_length[4096][3] > choice.cost_by_length[1024][3]
    assert LENGTHS[-1] >= 8000  # sized up to the longest context the goals name


def test_long_contexts_are_timed_on_a_filled_cache_as_after_a_prefill():
    """The plan times passes after 4k and 8k tokens on a cache whose positions past the first 64
    hold random keys and values: a row attends to all of them (its cost grows with them), the
    prefilled ones stay, and the timer runs every size."""
    from medusa.autotune.timing import FILL_AFTER, _fill, measure_cost
    from medusa.runtime import hf as kv
    from medusa.runtime import rows
    from medusa.runtime.kernels import PackedLinears

    model = tiny_model("llama")
    assert rows.supported(model) is None  # one-call passes: the cache is filled, not prefilled
    cache = kv.new_cache()
    ids = torch.arange(5, 5 + FILL_AFTER)[None]
    with torch.inference_mode():
        kv.forward(model, ids, torch.arange(FILL_AFTER)[None], cache, None, logits_rows=slice(-1, None))
        before = [layer.keys.clone() for layer in cache.layers]
        _fill(cache, model, FILL_AFTER, 700, 600)
    assert cache.get_seq_length() == 600
    for layer, kept in zip(cache.layers, before):
        assert torch.equal(layer.keys[..., :FILL_AFTER, :], kept)  # the prefill's own positions kept
        filled = layer.keys[..., FILL_AFTER:, :]
        assert filled.std() > 0.2 * kept.std() and filled.std() < 5 * kept.std()  # at the scale of real ones
    with PackedLinears(model, kernels="gemv"):
        cost = measure_cost(model, [1, 4], prefix=1500, reps=1, filled=True)
    assert set(cost) == {1, 4} and all(ms > 0 for ms in cost.values())


def test_trees_at_long_contexts_follow_the_acceptance_measured_there():
    from dataclasses import replace

    from medusa.autotune.sizing import context_bucket

    lengths = (300, 384, 900, 1536, 3100, 5999, 6000, 9000)
    assert [context_bucket(n) for n in lengths] == [None, 512, 1024, 2048, 4096, 4096, 8000, 8000]
    short = sizes_from(ENTRY, CURVES, max_rows=None, compiled=False)
    assert short.eagle.at(1000).nodes == 1  # the short prompts' acceptance: one node still pays at 1k
    # the heads keep little after ~1k tokens: plain decoding from 768 on, in both modes
    poor = {shape: replace(acc, accepted=[0.05, 0.06], hybrid=[[0.0, 0.05, 0.06]] * 3) for shape, acc in CURVES.items()}
    long = sizes_from(ENTRY, CURVES, max_rows=None, compiled=False, by_context={1024: poor})
    assert long.eagle.at(767).nodes == 1 and long.eagle.at(768).nodes == 0 and long.eagle.at(5000).nodes == 0
    assert (long.eagle.nodes, long.eagle.at(400).nodes) == (short.eagle.nodes, short.eagle.at(400).nodes)
    # the drafting cost is this machine's (the short curves'), not the calibration run's
    slow = {shape: replace(acc, draft_ms=50.0) for shape, acc in CURVES.items()}
    assert sizes_from(ENTRY, CURVES, None, False, by_context={512: slow}).eagle.longer == short.eagle.longer


def _state(tokens: list[int], hidden: torch.Tensor) -> DecodeState:
    return DecodeState(cache=None, tokens=tokens, length=len(tokens) - 1, root=torch.tensor(tokens[-1]),
                       hidden=hidden[-1], logits=None, prefill_hidden=hidden[:-1])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_engine_switches_sizes_at_their_lengths_and_stays_exact(arch):
    model = tiny_model(arch)
    prompt = [(7 * i + 3) % 90 + 3 for i in range(40)]
    ref = hf_greedy(model, prompt, 60)
    small = DynamicTree(nodes=0, depth=4, topk=2, chain=0)
    size = DynamicTree(nodes=6, depth=4, topk=2, chain=3, longer=((len(prompt) + 20, small),))
    heads = noisy_eagle(model)
    engine = Engine(model, heads=heads, plan=Plan(eagle=size, hybrid=size), proposer_config=DRAFTING)
    for mode in ("eagle", "hybrid"):
        proposer = engine.proposer(mode)
        assert (proposer.max_rows, proposer.min_rows) == ((7 if mode == "eagle" else 10), 1)
        steps: list[tuple[int, int]] = []
        drafting = proposer.steps  # (the engine drafts through the proposer's coroutine)

        def spy(state, drafting=drafting, steps=steps):
            proposal = yield from drafting(state)
            steps.append((state.length, proposal.tree.num_nodes))
            return proposal

        proposer.steps = spy
        res = engine.generate(prompt, max_new_tokens=60, mode=proposer)
        assert res.tokens == ref, mode
        before = [rows for length, rows in steps if length < len(prompt) + 20]
        after = [rows for length, rows in steps if length >= len(prompt) + 20]
        assert before and after and max(before) > 1, steps
        assert max(after) == 1, steps  # past the switch: no tree, no chain, plain decoding's one row
        drafting = proposer if mode == "eagle" else proposer.heads
        # and the head rests: no size drafts from there on, so no pairs are fed to it
        assert not drafting.active and drafting.length <= len(prompt) + 20 + size.depth, drafting.length
        # never more rows than the size for that length allows (root, nodes, chain)
        assert all(rows <= 1 + size.at(length).nodes + (size.at(length).chain if mode == "hybrid" else 0)
                   for length, rows in steps)
    assert isinstance(engine.proposer("hybrid"), Hybrid) and "from 60 tokens 0 nodes" in engine.proposer("eagle").describe()


def test_a_prompt_past_the_last_drafting_size_never_runs_the_head():
    """A prompt longer than where the sizes stop drafting: the head is not fed the prompt's pairs
    (that would cost a head pass over them for nothing), and the answer is the target's greedy."""
    model = tiny_model("llama")
    prompt = [(5 * i + 1) % 90 + 3 for i in range(48)]
    ref = hf_greedy(model, prompt, 12)
    size = DynamicTree(nodes=4, depth=3, topk=2, chain=2, longer=((32, DynamicTree(nodes=0, depth=3, topk=2, chain=2)),))
    engine = Engine(model, heads=noisy_eagle(model), plan=Plan(eagle=size, hybrid=size), proposer_config=DRAFTING)
    for mode in ("eagle", "hybrid"):
        proposer = engine.proposer(mode)
        head = proposer.heads if isinstance(proposer, Hybrid) else proposer
        assert isinstance(head, EagleProposer), type(head)
        assert engine.generate(prompt, max_new_tokens=12, mode=proposer).tokens == ref, mode
        assert not head.active and head.length == 0 and head.last is None, (mode, head.length)
        # a prompt short of the switch still feeds the head and drafts
        assert engine.generate(prompt[:20], max_new_tokens=4, mode=proposer).tokens == hf_greedy(model, prompt[:20], 4)
        assert head.length >= 20, (mode, head.length)


def test_block_heads_switch_sizes_too():
    model = tiny_model("llama")
    heads = init_block_for(model, block_size=4)
    prompt = [(5 * i + 1) % 90 + 3 for i in range(30)]
    small = DynamicTree(nodes=1, depth=1, topk=2)
    engine = Engine(model, heads=heads, plan=Plan(eagle=DynamicTree(nodes=6, depth=3, topk=2,
                                                                      longer=((40, small),))))
    proposer = engine.proposer("block")
    assert (proposer.max_rows, proposer.min_rows) == (7, 2)
    res = engine.generate(prompt, max_new_tokens=30, mode="block")
    assert res.tokens == hf_greedy(model, prompt, 30)


LONG = 2100  # cached tokens past 2k, and past the windowed models' 512-token window


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_every_mode_is_exact_after_a_prompt_of_over_2k_tokens(arch):
    window = {"qwen2": 512, "mistral": 512, "gemma3": 512}.get(arch)
    model = tiny_model(arch, max_position_embeddings=4096, **({"sliding_window": window} if window else {}))
    g = torch.Generator().manual_seed(3)
    # a long prompt with repeats in it (lookup's matches) and random stretches
    words = torch.randint(3, 90, (300,), generator=g).tolist()
    prompt = (words * 8)[:LONG - 30] + torch.randint(3, 90, (30,), generator=g).tolist()
    n = 24
    ref = hf_greedy(model, prompt, n)
    heads = {"medusa": init_heads_for(model, num_heads=3), "eagle": noisy_eagle(model),
             "eagle3": init_eagle3_for(model, num_steps=3), "block": init_block_for(model, block_size=4)}
    modes = {"medusa": ("medusa", "hybrid"), "eagle": ("eagle", "hybrid"), "eagle3": ("eagle3",), "block": ("block",)}
    for name, h in heads.items():
        engine = Engine(model, heads=h, draft=shallow_draft(model, 1))
        for mode in modes[name] + (("baseline", "lookup", "lookahead", "draft") if name == "medusa" else ()):
            assert engine.generate(prompt, max_new_tokens=n, mode=mode).tokens == ref, (arch, name, mode)


@pytest.mark.e2e
def test_the_embedded_model_with_shipped_heads_is_exact_after_a_long_document():
    import medusa
    from medusa.api import SHIPPED_EAGLE3_HEADS

    loaded = medusa.load(heads=str(SHIPPED_EAGLE3_HEADS), device="cpu", dtype="float32", autotune=False)
    # a real document of past 2k tokens (this repository's docs), to summarise
    text = "\n".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("docs/*.md")))
    ids = loaded.tokenizer(text)["input_ids"][:LONG] + loaded.tokenizer("\nSummarise the text above.\n")["input_ids"]
    n = 32
    ref = hf_greedy(loaded.model, ids, n)
    # the sizes switch mid-answer: a tree and chain first, past the switch a smaller tree, no chain
    size = DynamicTree(nodes=8, depth=4, topk=4, chain=4,
                       longer=((len(ids) + n // 2, DynamicTree(nodes=2, depth=4, topk=4, chain=0)),))
    engine = Engine(loaded.model, loaded.tokenizer, heads=loaded.heads, plan=Plan(eagle=size, hybrid=size))
    for mode in ("baseline", "eagle3", "lookup", "hybrid"):
        assert engine.generate(ids, max_new_tokens=n, mode=mode).tokens == ref, mode
