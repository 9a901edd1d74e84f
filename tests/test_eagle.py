"""EAGLE heads: exact greedy decoding with dynamic trees, the tree selection, folders of both kinds."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, DRAFTING, hf_greedy, tiny_model

import medusa
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.eagle import DynamicTree, EagleProposer, select
from medusa.decoding.tree import compile_tree
from medusa.errors import MedusaError
from medusa.models.eagle_heads import EagleHeads, init_eagle_for
from medusa.models.heads_config import save_heads
from medusa.models.loader import init_heads_for, load_heads

PROMPT = [1, 5, 9, 12, 40, 7, 7, 3, 22, 5, 9, 17]


def noisy_eagle(model, seed: int = 1, scale: float = 0.05) -> EagleHeads:
    """Eagle heads warm-started from the target's last layer, then moved by noise: right on
    some steps of the tiny model's repetitive text, wrong on others."""
    heads = init_eagle_for(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return heads


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle_and_eagle_hybrid_greedy_equal_target_greedy(arch):
    model = tiny_model(arch)
    n = 48
    ref = hf_greedy(model, PROMPT, n)
    eng = Engine(model, heads=noisy_eagle(model), proposer_config=DRAFTING)
    for mode in ("eagle", "hybrid"):
        res = eng.generate(PROMPT, max_new_tokens=n, mode=mode)
        assert res.tokens == ref, mode
    # the drafts are neither always right nor always wrong on this model
    res = eng.generate(PROMPT, max_new_tokens=n, mode="eagle")
    assert max(res.stats.accepted) > 1 and min(res.stats.accepted) == 1, res.stats.accepted


def test_eagle_decodes_past_the_head_cache_first_buffer():
    # The head's KV cache starts with 256 slots and regrows while drafting: a prompt of 250
    # tokens crosses that mid-answer (it once failed with an in-place update of an inference tensor).
    model = tiny_model("llama", max_position_embeddings=512)
    prompt = (PROMPT * 21)[:250]
    eng = Engine(model, heads=noisy_eagle(model))
    assert eng.generate(prompt, max_new_tokens=40, mode="eagle").tokens == hf_greedy(model, prompt, 40)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eagle_heads_forced_right_accept_the_full_depth(arch):
    # A final norm of zero makes every feature zero: the target's greedy answer is token 0
    # throughout, and the head, scoring through the same norm, drafts it at every depth.
    model = tiny_model(arch)
    with torch.no_grad():
        model.get_decoder().norm.weight.fill_(-1.0 if arch == "gemma3" else 0.0)  # Gemma's norm scales by 1 + w
    n, depth = 30, 5
    ref = hf_greedy(model, PROMPT, n)
    assert set(ref) == {0}
    heads = noisy_eagle(model)
    eng = Engine(model, heads=heads)
    proposer = EagleProposer(heads, torch.device("cpu"), DynamicTree(nodes=depth, depth=depth, topk=1))
    res = eng.generate(PROMPT, max_new_tokens=n, mode=proposer)
    assert res.tokens == ref
    assert all(a == depth + 1 for a in res.stats.accepted[:-1]), res.stats.accepted


def test_dynamic_tree_selection_golden():
    # depth 1: a (-0.1), b (-1.0); under a: aa (-0.3), ab (-2.0); under b: ba (-1.2)
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    scores = [-0.1, -1.0, -0.3, -2.0, -1.2]
    assert select(paths, scores, 3) == [0, 2, 1]  # a, aa, b
    assert select(paths, scores, 4) == [0, 2, 1, 4]  # then ba (-1.2) before ab (-2.0)
    # a child tied with its parent never comes before it; a child without its parent is skipped
    assert select([(0,), (0, 0)], [-0.5, -0.5], 2) == [0, 1]
    assert select([(0, 0), (1,)], [-0.1, -0.2], 2) == [1]
    tree = compile_tree([paths[i] for i in select(paths, scores, 4)])
    assert tree.paths == ((0,), (1,), (0, 0), (1, 0))
    assert tree.parent.tolist() == [-1, 0, 0, 1, 2]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2]


def test_dynamic_tree_tokens_follow_the_head_by_cumulative_probability():
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    eng = Engine(model, heads=heads)
    proposer = EagleProposer(heads, torch.device("cpu"), DynamicTree(nodes=6, depth=3, topk=2))
    state = eng._prefill(PROMPT, None, medusa.GenerationStats(), medusa.SamplingConfig(), 8)
    state.tokens.append(int(state.root))
    proposer.begin(state)
    proposal = proposer.propose(state)
    assert proposal.tree.num_nodes == 7 and proposal.tokens[0] == state.root
    # depth-1 nodes are the head's top-2 from its prediction of the root's feature
    logits = heads.logits(proposer.last)
    top2 = logits.topk(2).indices.tolist()
    depth1 = [int(t) for t, d in zip(proposal.tokens, proposal.tree.depth) if d == 1]
    assert depth1 == top2[: len(depth1)] and len(depth1) >= 1
    # drafting left no drafted pairs in the head's cache
    assert proposer.cache.get_seq_length() == state.length


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("draw", [0, 1, 2])  # top-k point masses; a drawn chain; drawn siblings
@pytest.mark.parametrize("mode", ["eagle", "hybrid"])
def test_eagle_sampling_keeps_the_target_distribution(mode, draw):
    # The exact-law chi-square check of test_sampling.py, with eagle heads drafting.
    from test_sampling import ALPHA, DRAWN_SAMPLING, V, chi_square_pvalue, engine_samples, target_law

    model = tiny_model("llama", vocab_size=V, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    sampling = DRAWN_SAMPLING[draw]
    eng = Engine(model, heads=noisy_eagle(model, scale=0.02), proposer_config=medusa.ProposerConfig(draw=draw))
    samples, drafted_hits = engine_samples(eng, mode, sampling, 300)
    assert chi_square_pvalue(samples, target_law(model, sampling, eng.eos)) > ALPHA
    assert drafted_hits > 0  # some drafts were accepted: the check covers the tree path


def test_eagle_folder_round_trip_and_kind_errors(tmp_path):
    model = tiny_model("qwen2")
    heads = noisy_eagle(model)
    folder = save_heads(heads, tmp_path / "eagle")
    back = load_heads(folder, model)
    assert isinstance(back, EagleHeads) and back.config.kind == "eagle"
    for (name, a), b in zip(heads.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    eng = Engine(model, heads=back)
    assert eng.generate(PROMPT, max_new_tokens=20, mode="eagle").tokens == hf_greedy(model, PROMPT, 20)
    with pytest.raises(MedusaError, match="needs medusa heads, but the loaded heads are eagle"):
        eng.generate(PROMPT, max_new_tokens=4, mode="medusa")
    with pytest.raises(MedusaError, match="needs eagle heads, but the loaded heads are medusa"):
        Engine(model, heads=init_heads_for(model)).generate(PROMPT, max_new_tokens=4, mode="eagle")
    with pytest.raises(MedusaError, match="built on their target"):
        load_heads(folder)
    with pytest.raises(MedusaError, match="hidden size"):
        load_heads(folder, tiny_model("qwen2", hidden_size=32, num_attention_heads=2))


def test_a_tree_given_for_eagle_heads_is_an_error_not_ignored():
    # eagle heads grow their tree per step: a static tree passed with them used to be
    # silently ignored (even a missing file); it still shapes Medusa heads' modes
    model = tiny_model("llama")
    eagle = noisy_eagle(model)
    with pytest.raises(MedusaError, match="these are eagle heads, whose tree grows per step"):
        Engine(model, heads=eagle, tree="cpu")
    eng = Engine(model, heads=eagle)
    for mode in ("eagle", "hybrid"):
        with pytest.raises(MedusaError, match="drop the tree"):
            eng.generate(PROMPT, max_new_tokens=4, mode=mode, tree="no-such-tree.json")
    ref = hf_greedy(model, PROMPT, 12)
    assert eng.generate(PROMPT, max_new_tokens=12, mode="lookup", tree=[[0]]).tokens == ref  # no heads: unused
    medusa_eng = Engine(model, heads=init_heads_for(model), tree=[[0], [0, 0]])
    assert medusa_eng.generate(PROMPT, max_new_tokens=12, mode="hybrid", tree=[[0]]).tokens == ref


def test_choose_dynamic_weighs_acceptance_against_pass_cost():
    from medusa.autotune.trees import Acceptance, choose_dynamic

    cost = {1: 10.0, 2: 10.0, 4: 20.0}  # a 2-token pass costs a 1-token pass; 4 tokens twice that
    curves = {(3, 2): Acceptance([0.6, 0.8, 0.9], 1.0)}  # accepted drafts with N = 1, 2, 3 nodes; 1 ms drafting
    size, expected, tps = choose_dynamic(curves, cost)
    # N=1: 1.6 / 11 ms; N=2: 1.8 / (15 + 1) ms; N=3: 1.9 / 21 ms -> N=1 wins
    assert (size.nodes, size.depth, size.topk) == (1, 3, 2)
    assert expected == pytest.approx(1.6) and tps == pytest.approx(1.6 / 11 * 1e3)
    # drafts that never hit: plain decoding (no drafting) wins
    size, expected, _ = choose_dynamic({(3, 2): Acceptance([0.0, 0.0], 1.0)}, cost)
    assert size.nodes == 0 and expected == 1.0


def test_acceptance_by_size_counts_the_longest_right_path():
    from medusa.autotune.trees import acceptance_by_size

    model = tiny_model("llama")
    with torch.no_grad():
        model.get_decoder().norm.weight.fill_(0.0)  # greedy answer: token 0 throughout, drafted right
    prompt = PROMPT
    answer = hf_greedy(model, prompt, 10)
    heads = noisy_eagle(model)
    result = acceptance_by_size(heads, model, [(prompt, answer)], DynamicTree(nodes=3, depth=3, topk=1))
    # at answer position i (0..8) the 3-node chain can be right for min(N, 9 - i) tokens
    expected = [sum(min(n, 9 - i) for i in range(9)) / 9 for n in (1, 2, 3)]
    assert result.accepted == pytest.approx(expected) and result.draft_ms > 0 and result.hybrid is None
    # the tree must be verifiable and the proposal unchanged by calibration: decoding still exact
    eng = Engine(model, heads=heads)
    assert eng.generate(prompt, max_new_tokens=10, mode="eagle").tokens == answer


def test_a_zero_node_tree_decodes_plainly():
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    proposer = EagleProposer(heads, torch.device("cpu"), DynamicTree(nodes=0, depth=1, topk=1))
    res = Engine(model, heads=heads).generate(PROMPT, max_new_tokens=12, mode=proposer)
    assert res.tokens == hf_greedy(model, PROMPT, 12) and set(res.stats.accepted) == {1}


def test_the_token_budget_caps_the_draft_depth():
    from medusa.decoding.state import DecodeState

    model = tiny_model("llama")
    heads = noisy_eagle(model)
    proposer = EagleProposer(heads, torch.device("cpu"), DynamicTree(nodes=4, depth=4, topk=1))  # a 4-chain
    seq = torch.tensor(PROMPT)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=seq[None]).last_hidden_state[0]  # [T, H]
    p = len(PROMPT) - 1
    state = DecodeState(cache=None, tokens=PROMPT, length=p, root=seq[p], hidden=hidden[p - 1], logits=None,
                        prefill_hidden=hidden[:p])
    proposer.begin(state)
    assert proposer.propose(state).tree.max_depth == 4  # no budget: the full depth
    for budget, depth in ((3, 2), (2, 1), (1, 0)):  # a step emits at most depth + 1 tokens
        state.budget = budget
        proposal = proposer.propose(state)
        assert proposal.tree.max_depth == depth and proposal.tokens.numel() == proposal.tree.num_nodes


def test_eagle1_layout_round_trips_and_old_folders_load_as_norms(tmp_path):
    import json

    from medusa.models.eagle_heads import additive_mask
    from medusa.runtime.hf import new_cache

    model = tiny_model("llama")
    one = init_eagle_for(model, num_steps=2, layout="eagle1")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in one.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    # vLLM's EAGLE-1 layer has no input norm: neither a parameter nor a computation here
    assert isinstance(one.layer.input_layernorm, torch.nn.Identity)
    assert not any("input_layernorm" in k for k in one.state_dict())
    back = load_heads(save_heads(one, tmp_path / "eagle1"), model)
    assert back.config.eagle_layout == "eagle1" and isinstance(back.layer.input_layernorm, torch.nn.Identity)
    n, h = 5, model.config.hidden_size
    feats, toks, pos = torch.randn(n, h), torch.tensor([4, 9, 11, 3, 7]), torch.arange(n)
    mask = additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.float32)
    with torch.no_grad():
        out = one(feats, toks, pos, new_cache(buffered=False), mask)
        assert torch.equal(back(feats, toks, pos, new_cache(buffered=False), mask), out)
        # no final norm: the output is the layer's residual stream, not normed
        assert not torch.allclose(model.get_decoder().norm(out), out)
    assert Engine(model, heads=back).generate(PROMPT, max_new_tokens=24, mode="eagle").tokens == hf_greedy(model, PROMPT, 24)

    # A folder written before layouts existed (no eagle_layout in config.json) loads as norms,
    # computing what it computed then; Medusa folders carry no such field.
    norms = noisy_eagle(model)
    folder = save_heads(norms, tmp_path / "old")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg.pop("eagle_layout") == "norms"
    (folder / "config.json").write_text(json.dumps(cfg))
    old = load_heads(folder, model)
    assert old.config.eagle_layout == "norms" and "layer.input_layernorm.weight" in old.state_dict()
    with torch.no_grad():
        ref = norms(feats, toks, pos, new_cache(buffered=False), mask)
        assert torch.equal(old(feats, toks, pos, new_cache(buffered=False), mask), ref)
        torch.testing.assert_close(model.get_decoder().norm(ref), ref)  # normed output (norm is idempotent here)
    medusa_cfg = json.loads((save_heads(init_heads_for(model), tmp_path / "medusa") / "config.json").read_text())
    assert "eagle_layout" not in medusa_cfg
    with pytest.raises(MedusaError, match="unknown eagle layout"):
        init_eagle_for(model, layout="eagle3")


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_drafting_window_keeps_the_heads_cache_small_and_the_output_exact(kind):
    """With ``draft_window`` the head's own cache slides: it never holds more accepted pairs than
    the window (drafted pairs come and go within a proposal), and greedy output is unchanged."""
    from medusa.decoding.request import make_request
    from medusa.models.eagle3_heads import init_eagle3_for

    model = tiny_model("llama", num_hidden_layers=2)
    heads = noisy_eagle(model) if kind == "eagle" else init_eagle3_for(model, 3)
    prompt = [(7 * i + 3) % 90 + 2 for i in range(60)]
    plain = Engine(model).generate(prompt, max_new_tokens=40, mode="baseline").tokens
    eng = Engine(model, heads=heads, proposer_config=medusa.ProposerConfig(draft_window=16))
    proposer = eng.proposer(kind)
    assert proposer.window == 16
    run = eng.decoding(make_request(prompt, max_new_tokens=40, mode=proposer))
    for _ in run.prefill_chunks():
        pass
    run.first_chunk()
    run.begin()
    assert proposer.cache.get_seq_length() == 16 and proposer.start == len(prompt) - 16
    while (proposal := run.propose()) is not None:
        run.advance(eng.step(run.state, proposal))
        assert proposer.cache.get_seq_length() <= 16 and proposer.length - proposer.start <= 16
    assert run.result().tokens == plain
    assert eng.generate(prompt, max_new_tokens=40, mode="hybrid").tokens == plain
    with pytest.raises(ValueError, match="window must be at least 1"):
        EagleProposer(heads, torch.device("cpu"), window=0)
