"""Sampling keeps the target's distribution: exact laws by enumeration vs Monte Carlo.

Every distribution check is a chi-square goodness-of-fit test against the exact law,
computed by enumerating every continuation with the target alone. Cells expected fewer
than 5 times are pooled into one; an outcome of probability 0 that shows up fails at once.
Each check rejects a correct sampler with probability ALPHA = 1e-4 (the false-alarm rate
per check; with the ~15 checks here, under 0.2% for the suite), and every generator is
seeded, so a run is deterministic. ``test_the_check_detects_a_lossy_rule`` shows the same
check does reject typical acceptance, which is lossy.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from tiny import tiny_model
from transformers import GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from medusa.decoding.engine import Engine
from medusa.decoding.proposers.factory import ProposerConfig
from medusa.decoding.sampling import SamplingConfig, probabilities, sample
from medusa.decoding.tree import chain, compile_tree
from medusa.decoding.verify import verify_sampled, verify_typical
from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads
from medusa.models.heads_config import HeadsConfig
from medusa.models.loader import init_heads_for

ALPHA = 1e-4
V = 16  # vocabulary of every model here
K = 3  # tokens whose joint law is checked
TREE = compile_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
# The sampling settings the kinds' exactness checks run each draw with: top-k point masses at
# T=0.8 with top-k 8; a drawn chain at T=0.7 and drawn siblings at T=1.0, both with top-p 0.9 (at
# T=1.0 with top-k 5 too: 300 samples of its flatter law leave too few chi-square cells)
DRAWN_SAMPLING = {0: SamplingConfig(temperature=0.8, top_k=8), 1: SamplingConfig(temperature=0.7, top_p=0.9),
                  2: SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)}


def chi_square_pvalue(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """P-value of ``samples`` under the exact ``law`` (outcome -> probability)."""
    m = len(samples)
    counts = Counter(samples)
    if any(law.get(o, 0.0) == 0.0 for o in counts):
        return 0.0  # an impossible outcome was drawn
    big = [o for o, p in law.items() if p * m >= 5]
    small_expected = m - sum(law[o] * m for o in big)
    small_observed = m - sum(counts[o] for o in big)
    cells = [(counts[o], law[o] * m) for o in big]
    if small_expected >= 1e-9:
        cells.append((small_observed, small_expected))
    chi2 = sum((obs - exp) ** 2 / exp for obs, exp in cells)
    df = len(cells) - 1
    assert df >= 5, "too few cells for a meaningful test"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


pytestmark = pytest.mark.usefixtures("one_thread")


# -- a bigram target: p(next | prefix) depends on the last token only ---------------------
def bigram_logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 2.0  # [V, V] row = logits after that token


def bigram_law(p: torch.Tensor, first: int) -> dict[tuple[int, ...], float]:
    """Exact law of the K tokens the bigram target ``p`` ``[V, V]`` samples after ``first``."""
    rows = p.double().tolist()
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(K):
        law = {seq + (x,): pr * px for seq, pr in law.items()
               for x, px in enumerate(rows[seq[-1] if seq else first]) if px > 0}
    return law


class Completer:
    """Extends an emitted prefix to K tokens by sampling the bigram target directly: what
    the following engine steps would do, in law."""

    def __init__(self, p: torch.Tensor, seed: int) -> None:
        self.rows = p.double().tolist()
        self.rng = random.Random(seed)

    def __call__(self, prefix: list[int]) -> tuple[int, ...]:
        seq = list(prefix[:K])
        while len(seq) < K:
            seq.append(self.rng.choices(range(V), weights=self.rows[seq[-1]])[0])
        return tuple(seq)


def emitted(tokens: torch.Tensor, acc) -> tuple[list[int], int]:
    """The tokens one verified step emits (accepted candidates, then the next token) and
    how many candidates were accepted; one host read."""
    length, nxt, *path = [int(acc.length), int(acc.next_token)] + acc.path.tolist()
    return [tokens[i] for i in path[1:length + 1]] + [nxt], length


def fixed_tokens(kind: str, root: int, p: torch.Tensor, g: torch.Generator) -> list[int]:
    """Deterministic candidates for TREE: the rank-r most likely (``good``) or least likely
    (``adversarial``) next token after the parent's token, or arbitrary tokens (``bad``;
    its root's first two children repeat the likeliest token: a repeat must not count twice)."""
    tokens = [root]
    for path in TREE.paths:
        parent = tokens[TREE.paths.index(path[:-1]) + 1] if len(path) > 1 else root
        order = p[parent].argsort(descending=(kind == "good"), stable=True)
        tokens.append(int(order[path[-1]]) if kind != "bad" else int(torch.randint(V, (1,), generator=g)))
    if kind == "bad":
        tokens[1] = tokens[2] = int(p[root].argmax())
    return tokens


@pytest.mark.parametrize("kind,sampling", [
    ("good", SamplingConfig(temperature=1.0)),
    ("good", SamplingConfig(temperature=0.7, top_k=5)),
    ("bad", SamplingConfig(temperature=1.3, top_p=0.8)),
    ("adversarial", SamplingConfig(temperature=0.5, top_k=8, top_p=0.9)),
])
def test_tree_of_fixed_candidates_is_lossless(kind, sampling):
    logits = bigram_logits(1)
    p = probabilities(logits, sampling)
    g, done = torch.Generator().manual_seed(2), Completer(p, 2)
    root, m, moved, samples = 3, 2000, 0, []
    tokens = fixed_tokens(kind, root, p, g)
    ids = torch.tensor(tokens)
    rows = logits[ids]  # [N, V] the bigram target's logits after each node
    for _ in range(m):
        out, length = emitted(tokens, verify_sampled(TREE, ids, rows, None, sampling, g))
        moved += length > 0
        samples.append(done(out))
    assert chi_square_pvalue(samples, bigram_law(p, root)) > ALPHA
    if kind == "good":
        assert moved > m / 2  # the check covered accepted candidates, not only residual draws


def test_root_only_tree_samples_p():
    # The baseline mode's tree: no candidates, the next token is a plain draw from p.
    logits, sampling = bigram_logits(4), SamplingConfig(temperature=0.9, top_p=0.95)
    p, g, tree = probabilities(logits, sampling), torch.Generator().manual_seed(5), compile_tree([])
    done, samples = Completer(p, 5), []
    for _ in range(2000):
        out, length = emitted([7], verify_sampled(tree, torch.tensor([7]), logits[[7]], None, sampling, g))
        assert length == 0
        samples.append(done(out))
    assert chi_square_pvalue(samples, bigram_law(p, 7)) > ALPHA


def draw_without_replacement(q_row: torch.Tensor, n: int, g: torch.Generator) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` tokens from ``q_row`` without replacement, and the law each was drawn from."""
    tokens, laws, left = [], [], q_row.clone()
    for _ in range(n):
        law = left / left.sum()
        t = int(sample(law, g))
        tokens.append(t)
        laws.append(law)
        left[t] = 0.0
    return tokens, laws


@pytest.mark.parametrize("paths,sampling", [
    (chain(3), SamplingConfig(temperature=1.0)),  # classic Leviathan/Chen rejection sampling
    (chain(2), SamplingConfig(temperature=0.6, top_k=6, top_p=0.9)),
    ([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)], SamplingConfig(temperature=1.2)),  # SpecInfer siblings
])
def test_sampled_candidates_with_their_q_are_lossless(paths, sampling):
    tree = compile_tree(paths)
    logits = bigram_logits(6)
    p = probabilities(logits, sampling)
    # The draft is another bigram model, sampled with the same controls; siblings are drawn
    # without replacement from it (so the draft needs enough support for the widest node).
    q_table = probabilities(bigram_logits(7), sampling.override(top_k=0, top_p=1.0))
    g, done = torch.Generator().manual_seed(8), Completer(p, 8)
    root, samples, moved = 5, [], 0
    for _ in range(2000):
        tokens = [root] + [0] * len(tree.paths)
        q = torch.zeros(tree.num_nodes, V)
        for parent in range(tree.num_nodes):
            kids = [i + 1 for i, path in enumerate(tree.paths)
                    if (tree.paths.index(path[:-1]) + 1 if len(path) > 1 else 0) == parent]
            drawn, laws = draw_without_replacement(q_table[tokens[parent]], len(kids), g)
            for kid, t, law in zip(kids, drawn, laws):
                tokens[kid], q[kid] = t, law
        ids = torch.tensor(tokens)
        out, length = emitted(tokens, verify_sampled(tree, ids, logits[ids], q, sampling, g))
        moved += length > 0
        samples.append(done(out))
    assert chi_square_pvalue(samples, bigram_law(p, root)) > ALPHA
    assert moved > 100


def test_the_check_detects_a_lossy_rule():
    # Typical acceptance takes likely candidates outright, so it over-produces them: the
    # same check that passes the lossless rule must reject it.
    logits, sampling = bigram_logits(1), SamplingConfig(temperature=1.0, acceptance="typical")
    p = probabilities(logits, sampling)
    g, done = torch.Generator().manual_seed(2), Completer(p, 2)
    tokens = fixed_tokens("good", 3, p, g)
    ids = torch.tensor(tokens)
    samples = [done(emitted(tokens, verify_typical(TREE, ids, logits[ids], sampling, g))[0]) for _ in range(2000)]
    assert chi_square_pvalue(samples, bigram_law(p, 3)) < ALPHA


# -- the engine on a real (tiny) transformer with Medusa heads --------------------------------
PROMPT = [5, 7, 3, 9]
ENGINE_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=V, num_hidden_layers=1, hidden_size=32, intermediate_size=64)


def target_law(model, sampling: SamplingConfig, eos: set[int]) -> dict[tuple[int, ...], float]:
    """Exact law of the first K generated tokens (cut after EOS), from one batched forward
    of the target over every two-token continuation of PROMPT."""
    n = len(PROMPT)
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(V * V, n), grid], dim=1)
    with torch.no_grad():
        p = probabilities(model(ids).logits[:, n - 1:], sampling).double()  # [V*V, 3, V]
    law: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], pr: float) -> None:
        if len(seq) == K or (seq and seq[-1] in eos):
            law[seq] = law.get(seq, 0.0) + pr
            return
        row = p[(seq[0] * V + seq[1]) if len(seq) == 2 else (seq[0] * V if seq else 0), len(seq)]
        for x in range(V):
            if row[x] > 0:
                walk(seq + (x,), pr * float(row[x]))

    walk((), 1.0)
    return law


def engine_samples(eng, mode: str, sampling: SamplingConfig, m: int, prompt=None) -> tuple[list[tuple[int, ...]], int]:
    """``m`` sampled continuations (seeds 0..m-1) of ``prompt`` (default PROMPT), ``K`` tokens
    each, and in how many the first step accepted a drafted token (the tree path was taken)."""
    samples, drafted_hits = [], 0
    for seed in range(m):
        res = eng.generate(prompt or PROMPT, max_new_tokens=K, mode=mode, sampling=sampling.override(seed=seed))
        samples.append(tuple(res.tokens))
        drafted_hits += bool(res.stats.accepted) and res.stats.accepted[0] > 1
    return samples, drafted_hits


def marginal_heads(model, sampling: SamplingConfig, sign: float) -> MedusaHeads:
    """Heads whose candidates at the prompt are the most (``sign`` 1) or least (-1) likely
    values of the 2nd and 3rd generated tokens: each per-head projection maps the
    prompt's last hidden state to ``sign * log marginal``."""
    with torch.no_grad():
        h0 = model.get_decoder()(torch.tensor([PROMPT])).last_hidden_state[0, -1]  # [H]
    law = target_law(model, sampling, eos=set())
    marg = torch.full((2, V), 1e-9, dtype=torch.float64)
    for seq, pr in law.items():
        marg[0, seq[1]] += pr
        marg[1, seq[2]] += pr
    heads = MedusaHeads(HeadsConfig(hidden_size=h0.numel(), vocab_size=V, num_heads=2, num_layers=1,
                                    projection="per_head"), lm_head=model.get_output_embeddings())
    with torch.no_grad():
        for k in range(2):  # zero-initialised blocks are the identity, so features == h0
            heads.proj[k].weight.copy_(torch.outer(sign * marg[k].log().float(), h0) / h0.dot(h0))
    return heads.eval()


@pytest.mark.parametrize("kind,sampling,draw", [
    ("good", SamplingConfig(temperature=0.7, top_k=6), 0),
    ("bad", SamplingConfig(temperature=0.8, top_p=0.9), 0),
    ("adversarial", SamplingConfig(temperature=1.0, top_k=8, top_p=0.95), 0),
    ("good", SamplingConfig(temperature=0.7, top_k=6), 1),  # drawn from each head: a chain
    ("good", DRAWN_SAMPLING[1], 1),
    ("bad", SamplingConfig(temperature=0.8, top_p=0.9), 2),  # drawn siblings
    ("bad", DRAWN_SAMPLING[2], 2),
    ("adversarial", SamplingConfig(temperature=1.0, top_k=8, top_p=0.95), 1),
])
def test_engine_medusa_sampling_matches_the_target(target, kind, sampling, draw):
    if kind == "bad":
        heads = init_heads_for(target, num_heads=2)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for prm in heads.parameters():
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
    else:
        heads = marginal_heads(target, sampling, 1.0 if kind == "good" else -1.0)
    eng = Engine(target, heads=heads, tree=ENGINE_TREE, proposer_config=ProposerConfig(draw=draw))
    samples, first_step_hits, m = [], 0, 400 if kind == "good" else 300
    for seed in range(m):
        res = eng.generate(PROMPT, max_new_tokens=K, sampling=sampling.override(seed=seed), mode="medusa")
        samples.append(tuple(res.tokens))
        first_step_hits += bool(res.stats.accepted) and res.stats.accepted[0] > 1
    assert chi_square_pvalue(samples, target_law(target, sampling, eng.eos)) > ALPHA
    if kind == "good":
        assert first_step_hits > m / 2  # most first steps accepted a head's candidate
    if kind == "adversarial":
        assert first_step_hits < m / 10


def test_same_seed_same_output(target):
    eng = Engine(target, heads=init_heads_for(target, num_heads=2), tree=ENGINE_TREE)
    runs = [eng.generate(PROMPT, max_new_tokens=40, temperature=1.0, top_p=0.95, seed=s).tokens for s in (0, 0, 1)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    again = eng.generate(PROMPT, max_new_tokens=40, temperature=1.0, top_p=0.95, seed=0, mode="baseline").tokens
    assert again == eng.generate(PROMPT, max_new_tokens=40, temperature=1.0, top_p=0.95, seed=0, mode="baseline").tokens


def test_typical_at_temperature_zero_is_greedy():
    model = tiny_model("llama")  # peaked and repetitive: zero-initialised heads get hits
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=ENGINE_TREE + [(0, 0, 0)])
    greedy = eng.generate(PROMPT, max_new_tokens=40, mode="baseline")
    typical = eng.generate(PROMPT, max_new_tokens=40, temperature=0, acceptance="typical")
    assert typical.tokens == greedy.tokens
    assert max(typical.stats.accepted) > 1  # candidates were accepted: the typical rule did the work


@pytest.mark.parametrize("temperature,top_k,top_p,vocab,scale", [
    (1.0, 0, 1.0, 40, 3.0), (0.7, 5, 1.0, 40, 3.0), (1.3, 0, 0.8, 40, 3.0), (0.5, 10, 0.6, 40, 3.0),
    # large vocabularies: the nucleus is found from a growing top-r instead of a full sort,
    # within the first 64 tokens (peaked) or only after several rounds (flat)
    (0.8, 0, 0.9, 5000, 4.0), (1.0, 0, 0.95, 5000, 0.3), (1.0, 300, 0.95, 5000, 0.3),
])
def test_probabilities_match_transformers_warpers(temperature, top_k, top_p, vocab, scale):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * scale
    scores = logits
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ours = probabilities(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours, scores.softmax(-1))
    assert ((ours > 0) == (scores.softmax(-1) > 0)).all()


def test_hf_generate_kwargs_give_hf_the_same_distribution(target):
    # transformers applies top-k 50 when top_k is unset; the kwargs must switch that off.
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    ids = torch.tensor([PROMPT])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                          output_logits=True, return_dict_in_generate=True,
                          generation_config=GenerationConfig(eos_token_id=2, pad_token_id=0,
                                                             **sampling.hf_generate_kwargs()))
    torch.testing.assert_close(out.scores[0].softmax(-1), probabilities(out.logits[0], sampling))


def test_sample_never_draws_a_zero_probability_token():
    probs = torch.zeros(4000, 50)
    probs[:, 7] = 1e-30
    probs[:, 20] = 1.0
    drawn = sample(probs, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) <= {7, 20}


def test_config_rejects_bad_values():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(top_k=2.5),
                dict(acceptance="fast"), dict(typical_epsilon=0.0)):
        with pytest.raises(MedusaError):
            SamplingConfig(**bad)
    with pytest.raises(MedusaError, match="unknown sampling option"):
        SamplingConfig().override(temprature=1.0)
    assert SamplingConfig(temperature=0.5).override(temperature=None, top_k=3) == SamplingConfig(temperature=0.5, top_k=3)


def test_seeds_outside_torch_s_range_are_one_line_errors_and_a_vanishing_temperature_is_greedy():
    for seed in (2**64, -(2**63) - 1, 1.5, True):
        with pytest.raises(MedusaError, match="seed must be a whole number"):
            SamplingConfig(temperature=0.7, seed=seed)
    assert SamplingConfig(temperature=0.7, seed=2**64 - 1).generator("cpu") is not None
    assert SamplingConfig(temperature=1e-40).greedy and not SamplingConfig(temperature=1e-4).greedy


# -- drawn proposals (medusa/decoding/proposers/drawn.py) --------------------------------------
def test_drawn_candidates_come_without_replacement_each_with_its_own_law():
    from medusa.decoding.proposers.drawn import draw, drawn_proposal

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, generator=g)
    ids = torch.arange(12) * 3 + 1  # a draft vocabulary: entry i is target id 3i + 1
    sampling = SamplingConfig(temperature=0.9, top_k=5)
    for _ in range(50):
        tokens, law = draw(logits, sampling, 3, g, ids, 40)
        assert tokens.shape == (3,) and law.shape == (3, 40) and len(set(tokens.tolist())) == 3
        assert torch.allclose(law.sum(-1), torch.ones(3)) and set(tokens.tolist()) <= set(ids.tolist())
        for j, t in enumerate(tokens.tolist()):
            assert law[j, t] > 0 and all(law[j, e] == 0 for e in tokens[:j].tolist())  # earlier ones removed
        support = (law[0] > 0).nonzero().view(-1).tolist()
        assert len(support) == 5 and all(i % 3 == 1 for i in support)  # top-k of the head, mapped
    # more candidates than top-k leaves tokens: as many as there are
    tokens, _ = draw(logits, SamplingConfig(temperature=0.9, top_k=2), 4, g, None, 12)
    assert tokens.numel() == 2
    # the first draws follow q: a chi-square of the first candidate against the processed law
    wide = SamplingConfig(temperature=0.9)  # every token in the law: enough cells for the test
    q = probabilities(logits, wide)
    firsts = [(int(draw(logits, wide, 1, g, None, 12)[0][0]),) for _ in range(3000)]
    assert chi_square_pvalue(firsts, {(i,): float(q[i]) for i in range(12) if q[i] > 0}) > ALPHA
    proposal = drawn_proposal(torch.tensor(7), [draw(logits, sampling, 2, g, None, 12) for _ in range(3)])
    assert proposal.tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1))
    assert proposal.q.shape == (7, 12) and not proposal.q[0].any() and proposal.tokens[0] == 7 and not proposal.is_chain
