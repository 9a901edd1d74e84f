"""EAGLE-3 heads: several target layers fused, their own vocabulary, seven unrolled steps.

Exact decoding on four architectures (random heads and heads forced right), the fused
features are the configured layers' inputs, training unrolls the configured steps and
learns, and folders round-trip with one-line errors for the wrong kind or target."""

import json

import pytest
import torch
from accelerate.state import AcceleratorState
from tiny import DRAFTING, hf_greedy, tiny_model
from train_fixtures import tiny_target, write_counting_data
from transformers import AutoModelForCausalLM

import medusa
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.models.eagle3_heads import Eagle3Heads, default_feature_layers, init_eagle3_for
from medusa.models.heads_config import read_heads_config, save_heads
from medusa.models.loader import load_heads
from medusa.runtime import hf as kv
from medusa.training.batches import collate
from medusa.training.data import Example
from medusa.training.eagle3_ttt import cached_batch, eagle3_loss, target_outputs
from medusa.training.eagle_ttt import sequences
from medusa.training.feature_build import build_cache
from medusa.training.feature_cache import FeatureCache, fingerprint, is_complete, run_layers
from medusa.training.loop import TrainConfig, train

ARCHS = ("llama", "qwen2", "mistral", "gemma3")


def prompt(seed: int, n: int = 12, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_random_eagle3_heads_decode_exactly(arch):
    model = tiny_model(arch)
    torch.manual_seed(1)
    heads = init_eagle3_for(model, 7, vocab=torch.arange(0, 96, 3))  # a draft vocabulary of a third
    engine = Engine(model, heads=heads)
    for seed in range(2):
        ids = prompt(seed)
        ref = hf_greedy(model, ids, 24)
        for mode in ("eagle3", "hybrid"):
            assert engine.generate(ids, max_new_tokens=24, mode=mode).tokens == ref, (arch, mode)
    # drafts are target ids of the draft vocabulary, mapped through d2t
    proposer = engine.proposer("eagle3")
    state = engine._prefill(prompt(3), None, medusa.GenerationStats(), medusa.SamplingConfig(), 8)
    state.tokens.append(int(state.root))
    proposer.begin(state)
    drafted = proposer.propose(state).tokens[1:].tolist()
    assert drafted and all(t % 3 == 0 for t in drafted), drafted


class Oracle(Eagle3Heads):
    """Heads forced right: each draft step knows the target's next token along its chain
    (the drafted tokens are looked up in the greedy continuation by position)."""

    def __init__(self, config, target, answer: dict[int, int]):
        super().__init__(config, target)
        self.answer = answer

    def step(self, features, tokens, positions, cache, mask):
        out = super().step(features, tokens, positions, cache, mask)
        # the pair at p predicts x_{p+2}; put the answer's id in the first feature coordinate
        out = out.clone()
        out[..., 0] = (positions + 2).to(out.dtype)
        return out

    def logits(self, features, vocab=None):
        pos = features[..., 0].round().long()
        ids = torch.tensor([self.answer.get(int(p), 0) for p in pos.reshape(-1)]).view(pos.shape)
        out = torch.full((*pos.shape, self.config.draft_vocab_size), -10.0)
        return out.scatter_(-1, ids[..., None], 10.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle3_heads_forced_right_are_accepted_in_full(arch):
    model = tiny_model(arch)
    ids = prompt(5)
    ref = hf_greedy(model, ids, 30)
    full = ids + ref
    heads = init_eagle3_for(model, 7)  # the whole vocabulary: every answer token can be drafted
    forced = Oracle(heads.config, model, {p: full[p] for p in range(len(full))})
    forced.load_state_dict(heads.state_dict())
    engine = Engine(model, heads=forced)
    res = engine.generate(ids, max_new_tokens=30, mode="eagle3")
    assert res.tokens == ref
    assert res.stats.tau > 2.5, res.stats.tau  # the drafts are right: many tokens per pass


def test_fused_features_are_the_configured_layers_inputs():
    model = tiny_model("llama")
    heads = init_eagle3_for(model, 3, feature_layers=[0, 1])
    ids = torch.tensor([prompt(2)])
    _, hidden = kv.forward(model, ids, torch.arange(ids.shape[1])[None], kv.new_cache(), None, layers=(0, 1))
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw, i=i: seen.__setitem__(i, (a[0] if a else kw["hidden_states"])[0]),
                                             with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        model.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    assert torch.allclose(hidden, torch.cat([seen[0], seen[1]], -1), atol=1e-6)
    assert heads.feature_layers == (0, 1) and heads.fc.in_features == 2 * model.config.hidden_size
    out = target_outputs(model, ids, torch.ones_like(ids), heads.feature_layers, 4)
    assert torch.allclose(out["features"][0], hidden, atol=1e-6)
    assert default_feature_layers(30) == [2, 15, 27]


def test_ttt_unrolls_the_configured_number_of_steps():
    model = tiny_model("llama")
    heads = init_eagle3_for(model, 7, vocab=torch.arange(48))
    ids = torch.tensor([prompt(3, 20), prompt(4, 20)])
    attn = torch.ones_like(ids)
    attn[1, 15:] = 0  # a shorter second sequence: its padding is never scored
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone(),
             **target_outputs(model, ids, attn, heads.feature_layers, 8)}
    calls = []
    step = heads.step
    heads.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    loss, counts = eagle3_loss(heads, batch, [1.0] * 7)
    assert len(calls) == 7 and counts["n"].shape == (7,)
    # step j scores positions p >= j with an answer label inside the sequence
    assert counts["n"][0] > counts["n"][6] > 0
    assert counts["n"][0] <= (20 - 2) + (15 - 2)
    loss.backward()
    assert heads.fc.weight.grad is not None and heads.lm_head.weight.grad.abs().sum() > 0


def test_eagle3_folder_round_trips_and_wrong_targets_get_one_line(tmp_path):
    model = tiny_model("llama")
    heads = init_eagle3_for(model, 7, vocab=torch.arange(10, 60))
    save_heads(heads, tmp_path / "h")
    cfg = read_heads_config(tmp_path / "h")
    assert cfg.kind == "eagle3" and cfg.draft_vocab_size == 50 and cfg.feature_layers == list(heads.feature_layers)
    back = load_heads(tmp_path / "h", model)
    assert isinstance(back, Eagle3Heads)
    assert torch.equal(back.draft_vocab, torch.arange(10, 60))
    for k, v in heads.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    with pytest.raises(MedusaError, match="pass the target model"):
        load_heads(tmp_path / "h")
    other = tiny_model("llama", vocab_size=80)
    with pytest.raises(MedusaError, match="use heads trained for this model"):
        load_heads(tmp_path / "h", other)
    data = json.loads((tmp_path / "h" / "config.json").read_text())
    data["feature_layers"] = [0]
    (tmp_path / "h" / "config.json").write_text(json.dumps(data))
    with pytest.raises(MedusaError, match="feature_layers"):
        load_heads(tmp_path / "h", model)
    with pytest.raises(MedusaError, match="needs eagle heads"):
        Engine(model, heads=heads).generate(prompt(1), max_new_tokens=4, mode="eagle")


@pytest.fixture()
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield


@pytest.mark.parametrize("cached", [False, True], ids=["target-each-step", "feature-cache"])
def test_eagle3_training_learns_and_the_heads_decode(tmp_path, fresh_accelerate_state, cached):
    folder = tiny_target(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.no_grad():  # peaked next-token distributions: something to learn
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    data = write_counting_data(tmp_path / "count.jsonl", 48)
    out = tmp_path / "eagle3"
    cfg = TrainConfig(model=str(folder), data=[str(data)], kind="eagle3", num_heads=7, max_length=48, eval_fraction=0.1,
                      batch_size=4, lr=3e-3, warmup_steps=2, max_steps=150, eval_every=150, eval_batches=0, log_every=5,
                      save_every=0, output=str(out), wandb=False, train_vocab=16, seed=3,
                      cache_dir=str(tmp_path / "features") if cached else None)
    train(cfg)
    if cached:  # the target ran once, over the layers the heads fuse
        meta = json.loads((tmp_path / "features" / "train" / "meta.json").read_text())
        assert meta["layers"] == list(read_heads_config(out).feature_layers), meta
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    for k in (1, 4, 7):  # the first, a middle and the last unrolled step learned
        assert evals[-1][f"head{k}/top1"] > evals[0][f"head{k}/top1"] + 0.2, (k, evals)
    assert read_heads_config(out).kind == "eagle3", read_heads_config(out)
    assert read_heads_config(out).draft_vocab_size == 16, read_heads_config(out)
    engine = medusa.load(model=str(folder), heads=str(out), device="cpu", autotune=False, proposers=DRAFTING)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "count from three please"}],
                                               add_generation_prompt=True)
    base = engine.generate(ids, max_new_tokens=20, mode="baseline")
    res = engine.generate(ids, max_new_tokens=20, mode="eagle3")
    assert res.tokens == base.tokens
    torch.manual_seed(0)
    fresh = init_eagle3_for(engine.model, 7, vocab=engine.heads.draft_vocab)
    untrained = Engine(engine.model, heads=fresh, proposer_config=DRAFTING).generate(ids, max_new_tokens=20, mode="eagle3")
    assert untrained.tokens == base.tokens
    assert res.stats.tau > max(1.25, untrained.stats.tau + 0.2), (res.stats.tau, untrained.stats.tau)


def test_eagle3_config_refuses_lora():
    with pytest.raises(MedusaError, match="drop lora"):
        TrainConfig(kind="eagle3", lora=True, data=["d"])


def _examples(n: int, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 6 + 3 * i
        ids = torch.randint(3, 96, (length,), generator=g).tolist()
        out.append(Example(ids, [0] * (length // 2) + [1] * (length - length // 2)))
    return out


def test_the_feature_cache_holds_what_the_target_gives_eagle3_training(tmp_path):
    # A batch read from the cache equals the target run on the same sequences: tokens, masks and
    # teacher exactly, the fused layers' inputs to bfloat16 rounding; the layers key the cache.
    model = tiny_model("llama", vocab_size=96, num_hidden_layers=4, tie_word_embeddings=False)
    layers = (0, 2, 3)
    with torch.no_grad():  # a residual stream past float16's range (as in Gemma 3's middle layers)
        model.model.embed_tokens.weight.mul_(1e6)
    examples = _examples(5)
    h = model.config.hidden_size
    fp = fingerprint(model, examples, 8, layers=layers)
    assert fp != fingerprint(model, examples, 8) and fp != fingerprint(model, examples, 8, layers=(0, 1, 3))
    build_cache(tmp_path / "c", lambda i, a: run_layers(model, layers, i, a), examples, 3 * h, 8, fp,
                batch_tokens=24, bfloat16=True, meta={"layers": list(layers)})
    assert is_complete(tmp_path / "c", fp)
    cache = FeatureCache.open(tmp_path / "c")
    bounds = sequences(cache)[[1, 4, 2]]
    got = cached_batch(cache, bounds, torch.device("cpu"))
    want = collate([examples[i] for i in (1, 4, 2)], torch.device("cpu"))
    for name in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(got[name], want[name]), name
    ref = target_outputs(model, want["input_ids"], want["attention_mask"], layers, 8)
    valid = want["attention_mask"].bool()
    assert ref["features"][valid].abs().max() > 1e5  # float16 would have overflowed
    assert torch.isfinite(got["features"]).all()
    torch.testing.assert_close(got["features"][valid], ref["features"][valid], rtol=1e-2, atol=1e-3)
    assert torch.equal(got["teacher_ids"][valid], ref["teacher_ids"][valid])
    torch.testing.assert_close(got["teacher_logp"][valid], ref["teacher_logp"][valid], rtol=2e-3, atol=2e-3)
    assert not got["attention_mask"][~valid].any() and not got["features"][~valid].any()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("draw", [0, 1, 2])  # top-k point masses; a drawn chain; drawn siblings
@pytest.mark.parametrize("mode", ["eagle3", "hybrid"])
def test_eagle3_sampling_keeps_the_target_distribution(mode, draw):
    # The exact-law chi-square check of test_sampling.py, with eagle3 heads drafting.
    from test_sampling import ALPHA, DRAWN_SAMPLING, V, chi_square_pvalue, engine_samples, target_law

    model = tiny_model("llama", vocab_size=V, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    torch.manual_seed(4)
    heads = init_eagle3_for(model, 3)  # lm_head starts as the target's rows: its drafts are often right
    sampling = DRAWN_SAMPLING[draw]
    eng = Engine(model, heads=heads, proposer_config=medusa.ProposerConfig(draw=draw))
    samples, drafted_hits = engine_samples(eng, mode, sampling, 300)
    assert chi_square_pvalue(samples, target_law(model, sampling, eng.eos)) > ALPHA
    assert drafted_hits > 0  # some drafts were accepted: the check covers the tree path


@pytest.mark.usefixtures("one_thread")
def test_hybrid_sized_without_a_tree_drafts_sampled_requests_with_the_heads():
    # Sized by greedy acceptance, hybrid may keep only the lookup chain (no heads tree); a
    # sampled request then drafts with the heads as mode eagle3 is sized, their drawn rows
    # beside the chain's point masses: still the target's law (chi-square), while a greedy
    # request never runs the heads and keeps the target's greedy tokens.
    from test_sampling import ALPHA, V, chi_square_pvalue, engine_samples, target_law

    from medusa.decoding.plan import Plan
    from medusa.decoding.proposers.eagle import DynamicTree

    model = tiny_model("llama", vocab_size=V, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    torch.manual_seed(4)
    heads = init_eagle3_for(model, 3)
    plan = Plan(eagle=DynamicTree(nodes=4, depth=3, topk=2), hybrid=DynamicTree(nodes=0, depth=3, topk=2, chain=3))
    eng = Engine(model, heads=heads, plan=plan)
    proposer = eng.proposer("hybrid")
    assert "sampled requests: a drawn chain within 4 nodes" in proposer.describe()
    sampling = medusa.SamplingConfig(temperature=0.8, top_k=8)
    samples, drafted_hits = engine_samples(eng, "hybrid", sampling, 300)
    assert chi_square_pvalue(samples, target_law(model, sampling, eng.eos)) > ALPHA
    assert drafted_hits > 0
    ids = [3, 1, 4, 1, 5]
    calls, step = [], heads.step
    heads.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    greedy = eng.generate(ids, max_new_tokens=12, mode="hybrid")
    assert greedy.tokens == hf_greedy(model, ids, 12) and not calls  # the heads never ran
    eng.generate(ids, max_new_tokens=12, mode="hybrid", sampling=sampling.override(seed=1))
    assert calls  # a sampled request runs them
    assert eng.proposer("eagle3").describe() == "dynamic tree (4 nodes, depth 3, top-2)"


@pytest.mark.peers
def test_compiled_passes_return_the_fused_layers(tmp_path, monkeypatch):
    # A saved CPU graph compiled for eagle3 heads returns the layers they read (its file is
    # keyed by them), and decoding through it stays exact. Compiled before any pass ran (the
    # bench's and the chat's order): transformers installs its hidden-state hooks on first use
    # under a lock dynamo cannot trace, so the example pass installs them eagerly first.
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    model = tiny_model("llama")
    torch.manual_seed(1)
    heads = init_eagle3_for(model, 3)
    engine = Engine(model, heads=heads, compile=True)
    engine.precompile("eagle3")
    assert engine.passes.saved.fallback is None and engine.passes.saved.traced
    ids = prompt(6)
    res = engine.generate(ids, max_new_tokens=20, mode="eagle3")
    assert res.tokens == hf_greedy(model, ids, 20)
    assert engine.passes.features == heads.feature_layers and engine.passes.saved.traced
    assert engine.passes.saved.fallback is None
    names = [p.name for p in (tmp_path / "compiled").glob("pass-*.bin")]
    assert names and all("-L" + "_".join(map(str, heads.feature_layers)) in n for n in names), names


def test_vocab_fill_completes_a_draft_vocabulary_the_data_cannot_fill(tmp_path, fresh_accelerate_state):
    """Answers with few distinct tokens (a small data set, a huge vocabulary): the draft vocabulary
    takes every token of the data, then the most frequent tokens of the vocab_fill answers."""
    from train_fixtures import make_tokenizer

    folder = tiny_target(tmp_path / "model")
    data = write_counting_data(tmp_path / "count.jsonl", 16)
    fill = tmp_path / "fill.jsonl"
    fill.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "count"},
                                                      {"role": "assistant", "content": text}]}) + "\n"
                            for text in ("ok please ok", "system ok please", "ok")))
    base = dict(model=str(folder), data=[str(data)], kind="eagle3", num_heads=2, max_length=48, eval_fraction=0.1,
                batch_size=4, max_steps=1, eval_every=0, eval_batches=0, save_every=0, wandb=False)
    tok = make_tokenizer()
    words = [t for t in tok.get_vocab() if t in ("ok", "please", "system")]
    train(TrainConfig(**base, output=str(tmp_path / "plain"), train_vocab=16))
    AcceleratorState._reset_state(True)
    train(TrainConfig(**base, output=str(tmp_path / "filled"), train_vocab=16, vocab_fill=[str(fill)]))
    model = AutoModelForCausalLM.from_pretrained(folder)
    plain = set(load_heads(tmp_path / "plain", model).draft_vocab.tolist())
    filled = set(load_heads(tmp_path / "filled", model).draft_vocab.tolist())
    ok, please, system = (tok.convert_tokens_to_ids(w) for w in ("ok", "please", "system"))
    assert len(words) == 3 and len(plain) == len(filled) == 16
    answer_ids = {t for line in data.read_text().splitlines()
                  for t in tok(json.loads(line)["messages"][-1]["content"], add_special_tokens=False)["input_ids"]}
    assert answer_ids <= filled and answer_ids <= plain  # the data's own tokens come first
    assert {ok, please} <= filled, (sorted(filled), ok, please)  # then the fill's most frequent
    assert filled - plain and not {ok, please} <= plain
    with pytest.raises(MedusaError, match="vocab_fill file not found"):
        AcceleratorState._reset_state(True)
        train(TrainConfig(**base, output=str(tmp_path / "x"), train_vocab=16, vocab_fill=[str(tmp_path / "nope.jsonl")]))
