"""Draft-model speculative decoding: exact greedy output, caches in sync, vocabulary checks."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from tiny import ARCHS, DRAFTING, hf_greedy, tiny_model
from tiny_heads import VOCAB, target_folder, word_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import medusa
from medusa.decoding.engine import Engine, StepOutcome
from medusa.decoding.proposers.draft_model import DraftModel
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.decoding.sampling import SamplingConfig, probabilities
from medusa.errors import MedusaError
from medusa.models import draft as draft_module
from medusa.models.draft import check_compatible, load_draft, shallow_draft
from medusa.models.target import load_target
from medusa.runtime import hf as kv

PROMPT = [5, 17, 33, 9, 41, 12]


pytestmark = pytest.mark.usefixtures("one_thread")


def noisy_copy(model, scale, seed=1):
    """The target with every weight nudged: agrees with it often but not always."""
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    copy.generation_config = model.generation_config
    return copy.eval().requires_grad_(False)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_greedy_equals_target_greedy(arch):
    target = tiny_model(arch)
    n = 40
    ref = hf_greedy(target, PROMPT, n)
    # good, truncated, close and unrelated drafts, each with its own draft length
    cases = [("itself", target, 4, False), ("shallow", shallow_draft(target, 1), 1, False),
             ("noisy", noisy_copy(target, 0.02), 3, True), ("unrelated", tiny_model(arch, seed=7), 2, False)]
    for name, draft, k, adaptive in cases:
        eng = Engine(target, draft=draft, proposer_config=ProposerConfig(draft_tokens=k, adaptive_draft=adaptive,
                                                                          draft_confidence=0.0, check_drafting=False))  # full chains
        res = eng.generate(PROMPT, max_new_tokens=n, mode="draft")
        assert res.tokens == ref, name
        if name == "itself":
            # A draft identical to the target is always right: every step accepts all k
            # candidates plus the bonus token (the last step may be cut short).
            assert all(a == k + 1 for a in res.stats.accepted[:-1]), res.stats.accepted


def test_adaptive_draft_length_grows_and_shrinks():
    target = tiny_model("llama")
    ref = hf_greedy(target, PROMPT, 30)
    eng = Engine(target, proposer_config=DRAFTING)
    grow = DraftModel(target, eng.device, num_tokens=1, adaptive=True, max_tokens=7)
    assert eng.generate(PROMPT, max_new_tokens=30, mode=grow).tokens == ref
    assert grow.k == 7  # a perfect draft grows k by 2 per step up to the cap
    shrink = DraftModel(tiny_model("llama", seed=7), eng.device, num_tokens=6, adaptive=True)
    res = eng.generate(PROMPT, max_new_tokens=30, mode=shrink)
    assert res.tokens == ref
    assert shrink.k < 6


def test_confidence_ends_chains_early_without_changing_the_output():
    target = tiny_model("llama")
    ref = hf_greedy(target, PROMPT, 30)
    eng = Engine(target, proposer_config=DRAFTING)
    # a threshold no draft token reaches: every chain stops after its first token
    always = DraftModel(target, eng.device, num_tokens=4, confidence=1.01)
    res = eng.generate(PROMPT, max_new_tokens=30, mode=always)
    assert res.tokens == ref and max(res.stats.accepted) == 2
    never = DraftModel(target, eng.device, num_tokens=4, confidence=1e-9)
    res = eng.generate(PROMPT, max_new_tokens=30, mode=never)
    assert res.tokens == ref and max(res.stats.accepted) == 5


def sequential_cache(model, tokens):
    cache = kv.new_cache()
    kv.forward(model, torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, None, logits_rows=slice(-1, None))
    return cache


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_cache_stays_in_sync_after_partial_acceptance(arch):
    target = tiny_model(arch)
    draft = noisy_copy(target, 0.02)
    eng = Engine(target, proposer_config=DRAFTING)
    k = 4
    proposer = DraftModel(draft, eng.device, num_tokens=k)
    gen = eng.stream(PROMPT, max_new_tokens=60, mode=proposer)
    emitted = next(gen)  # the prefill's token; the draft has not run yet
    checked = 0
    for chunk in gen:
        emitted += chunk
        full = PROMPT + emitted
        tokens = proposer.cached
        # The draft cache holds a prefix of the sequence that lacks at most the new root
        # and, after a fully accepted chain, the last draft token (never fed to the draft).
        assert tokens == full[: len(tokens)]
        if len(emitted) < 60:  # (a last step cut by the length limit emits fewer tokens)
            assert len(full) - 2 <= len(tokens) <= len(full) - 1
        assert kv.cache_length(proposer.cache) == len(tokens)
        ref = sequential_cache(draft, tokens)
        for got, want in zip(kv._layers(proposer.cache), kv._layers(ref), strict=True):
            torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-5)
        checked += 1
    accepted = gen.result.stats.accepted
    assert gen.result.tokens == hf_greedy(target, PROMPT, 60)
    # the run saw partial acceptance (some but not all of k), full acceptance and rejection
    assert any(1 < a < k + 1 for a in accepted) and (k + 1) in accepted and 1 in accepted, accepted
    assert checked == len(accepted)


def swapped_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny target's word-level tokenizer with the ids of two words swapped: same size,
    different mapping, so only a real vocabulary comparison tells them apart."""
    vocab = word_tokenizer().get_vocab()
    vocab.update(w4=vocab["w5"], w5=vocab["w4"])
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_mismatched_tokenizer_is_a_one_line_error(tmp_path):
    target_dir = target_folder(tmp_path)
    other = tmp_path / "other"
    tiny_model("llama", vocab_size=VOCAB).save_pretrained(other)
    swapped_tokenizer().save_pretrained(other)
    with pytest.raises(MedusaError) as err:
        medusa.load(model=str(target_dir), draft=str(other), device="cpu")
    message = str(err.value)
    assert "\n" not in message and str(other) in message and str(target_dir) in message and "tokenizer" in message


def test_mismatched_vocabulary_size_is_a_one_line_error(tmp_path):
    target = tiny_model("llama", vocab_size=VOCAB)
    bigger = tiny_model("llama", vocab_size=VOCAB + 32)
    with pytest.raises(MedusaError) as err:
        check_compatible(target, None, bigger, None, "TARGET", "DRAFT")
    message = str(err.value)
    assert "\n" not in message and "TARGET" in message and "DRAFT" in message
    assert str(VOCAB) in message and str(VOCAB + 32) in message


def test_load_with_a_draft_folder_decodes_like_the_target(tmp_path):
    target_dir = target_folder(tmp_path)
    draft_dir = tmp_path / "draft"
    target, tok = load_target(str(target_dir), device="cpu")
    shallow_draft(target, 1).save_pretrained(draft_dir)
    tok.save_pretrained(draft_dir)
    eng = medusa.load(model=str(target_dir), draft=str(draft_dir), device="cpu", draft_tokens=3)
    assert eng.draft.config.num_hidden_layers == 1 and eng.proposer_config.draft_tokens == 3
    res = eng.generate(PROMPT, max_new_tokens=30, mode="draft")
    assert res.tokens == hf_greedy(eng.model, PROMPT, 30)


def test_draft_mode_without_a_draft_is_a_clear_error():
    with pytest.raises(MedusaError, match="needs a draft model"):
        Engine(tiny_model("llama")).generate(PROMPT, mode="draft")


@pytest.mark.parametrize("arch", ARCHS)
def test_shallow_draft_is_the_targets_early_exit(arch):
    target = tiny_model(arch)
    ids = torch.tensor([PROMPT])
    layers = target.config.num_hidden_layers
    full = shallow_draft(target, layers)
    torch.testing.assert_close(full(ids).logits, target(ids).logits)
    one = shallow_draft(target, 1)
    assert one.config.num_hidden_layers == 1
    assert sum(p.numel() for p in one.parameters()) < sum(p.numel() for p in target.parameters())
    # first layer of the target, then the final norm and the (tied) output projection
    hidden = target(ids, output_hidden_states=True).hidden_states[1]
    base = target.get_decoder()
    expected = kv.lm_logits(target, base.norm(hidden))  # the target's own head post-processing
    torch.testing.assert_close(one(ids).logits, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(MedusaError, match="layers"):
        shallow_draft(target, layers + 1)


def test_default_draft_prefers_the_distilled_folder(tmp_path, monkeypatch):
    target = tiny_model("llama", vocab_size=VOCAB)
    tok = word_tokenizer()
    monkeypatch.setattr(draft_module, "default_draft_dir", lambda: tmp_path / "distilled")
    with pytest.warns(UserWarning, match="undistilled"):
        fallback = load_draft("default", target, tok, "tiny", embedded_target=True)
    assert fallback.config.num_hidden_layers == min(draft_module.DEFAULT_DRAFT_LAYERS, target.config.num_hidden_layers)
    distilled = shallow_draft(target, 1)
    distilled.save_pretrained(tmp_path / "distilled")
    tok.save_pretrained(tmp_path / "distilled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_draft("default", target, tok, "tiny", embedded_target=True)
    assert loaded.config.num_hidden_layers == 1


def test_draft_respects_the_context_window():
    target = tiny_model("llama", max_position_embeddings=24)
    eng = Engine(target, draft=target, proposer_config=ProposerConfig(draft_tokens=5))
    res = eng.generate(PROMPT, max_new_tokens=100, mode="draft")
    assert res.finish_reason == "context"
    assert len(PROMPT) + len(res.tokens) == 24 + 1
    assert res.tokens == hf_greedy(target, PROMPT, len(res.tokens))


# -- sampling: the output follows the target's distribution, whatever the draft -------------
V, K = 16, 3  # tiny vocabulary; the joint law of the first K tokens is checked
SAMPLING_PROMPT = [5, 7, 3, 9]
ALPHA = 1e-4  # false-alarm rate of each check; every generator is seeded, so runs repeat


def small_model(seed: int):
    return tiny_model("llama", seed=seed, vocab_size=V, num_hidden_layers=1, hidden_size=32, intermediate_size=64)


def exact_law(model, sampling: SamplingConfig, eos: set[int]) -> dict[tuple[int, ...], float]:
    """The law of the first K sampled tokens (cut after EOS), by enumerating every
    continuation: one batched forward over all V*V two-token extensions of the prompt."""
    n = len(SAMPLING_PROMPT)
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]
    ids = torch.cat([torch.tensor(SAMPLING_PROMPT).expand(V * V, n), grid], dim=1)
    with torch.no_grad():
        p = probabilities(model(ids).logits[:, n - 1:], sampling).double()  # [V*V, 3, V]
    law: dict[tuple[int, ...], float] = {}
    stack = [((), 1.0)]
    while stack:
        seq, pr = stack.pop()
        if len(seq) == K or (seq and seq[-1] in eos):
            law[seq] = law.get(seq, 0.0) + pr
            continue
        # the grid row whose first len(seq) tokens are seq (any row for the first token)
        row = p[(seq[0] * V if seq else 0) + (seq[1] if len(seq) == 2 else 0), len(seq)]  # [V] p after seq
        stack += [(seq + (x,), pr * float(row[x])) for x in range(V) if row[x] > 0]
    return law


def chi_square_pvalue(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of ``samples`` to ``law``; cells expected fewer than 5 times are pooled."""
    m, counts = len(samples), Counter(samples)
    if any(law.get(o, 0.0) == 0.0 for o in counts):
        return 0.0  # an impossible outcome was drawn
    big = [o for o, pr in law.items() if pr * m >= 5]
    cells = [(counts[o], law[o] * m) for o in big]
    rest = m - sum(e for _, e in cells)
    if rest > 1e-9:
        cells.append((m - sum(c for c, _ in cells), rest))
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    assert df >= 5, "too few cells for a meaningful test"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.mark.parametrize("draft_kind, k, sampling", [
    ("close", 2, SamplingConfig(temperature=1.0)),
    ("close", 3, SamplingConfig(temperature=0.7, top_k=6, top_p=0.9)),
    ("unrelated", 2, SamplingConfig(temperature=0.6, top_p=0.95)),
])
def test_draft_sampling_preserves_the_target_distribution(draft_kind, k, sampling):
    target = small_model(0)
    draft = noisy_copy(target, 0.03) if draft_kind == "close" else small_model(5)
    eng = Engine(target, draft=draft, proposer_config=ProposerConfig(draft_tokens=k))
    samples, drafted_hits, m = [], 0, 400
    for seed in range(m):
        res = eng.generate(SAMPLING_PROMPT, max_new_tokens=K, mode="draft", sampling=sampling.override(seed=seed))
        samples.append(tuple(res.tokens))
        drafted_hits += bool(res.stats.accepted) and res.stats.accepted[0] > 1
    assert chi_square_pvalue(samples, exact_law(target, sampling, eng.eos)) > ALPHA
    if draft_kind == "close":
        assert drafted_hits > m / 3  # the check covered accepted draft tokens, not only resampling


def test_lookup_sampling_preserves_the_target_distribution():
    # Lookup candidates are deterministic given the text: point masses for the verifier.
    target = small_model(0)
    eng = Engine(target)
    sampling = SamplingConfig(temperature=0.8)
    samples, moved = [], 0
    for seed in range(400):
        res = eng.generate(SAMPLING_PROMPT, max_new_tokens=K, mode="lookup", sampling=sampling.override(seed=seed))
        samples.append(tuple(res.tokens))
        moved += any(a > 1 for a in res.stats.accepted)
    assert chi_square_pvalue(samples, exact_law(target, sampling, eng.eos)) > ALPHA
    assert moved > 10


def test_draft_q_rows_are_the_drafts_processed_distribution():
    # What the verifier is told must be exactly the law each draft token was drawn from:
    # the draft's distribution after the chain so far, with the target's sampling controls.
    target, draft = small_model(0), small_model(5)
    sampling = SamplingConfig(temperature=0.7, top_k=6, seed=3)
    state = Engine(target).generate(SAMPLING_PROMPT, max_new_tokens=2, sampling=sampling, mode="baseline").state
    proposer = DraftModel(draft, torch.device("cpu"), num_tokens=4)
    proposer.begin(state)
    for _ in range(2):  # the second proposal runs on the cache the first one left
        state.root = torch.tensor(state.tokens[-1])
        proposal = proposer.propose(state)
        chain_tokens = proposal.tokens.tolist()
        assert chain_tokens[0] == state.tokens[-1] and len(chain_tokens) == 5 and proposal.q.shape == (5, V)
        with torch.no_grad():
            logits = draft(torch.tensor([state.tokens + chain_tokens[1:-1]])).logits[0, -4:]  # [4, V]
        torch.testing.assert_close(proposal.q[1:], probabilities(logits, sampling), rtol=1e-4, atol=1e-6)
        assert (proposal.q[1:].gather(1, proposal.tokens[1:, None]) > 0).all()
        state.tokens += chain_tokens[1:3]  # as if the target accepted two tokens and added one
        state.tokens.append((chain_tokens[3] + 1) % V)
        proposer.update(state, StepOutcome(nodes=[0, 1, 2], tokens=state.tokens[-3:], hidden=torch.zeros(3, 1),
                                           start=0))
