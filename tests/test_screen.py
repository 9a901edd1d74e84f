"""The vocabulary screen (medusa/runtime/screen.py): a greedy row's argmax from a bfloat16 product
and a few float32 outputs, the same as the whole float32 product's, on the gemv kernels built
here and tiny real models."""

from __future__ import annotations

import pytest
import torch
from tiny import hf_greedy, tiny_model

from medusa.decoding.engine import Engine
from medusa.decoding.penalties import Penalties
from medusa.decoding.plan import Plan
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.loader import init_heads_for
from medusa.runtime import gemv, screen
from medusa.runtime import hf as kv
from medusa.runtime.kernels import PackedLinears
from medusa.serving.scheduler import Scheduler


def test_pick_gives_the_whole_products_bits():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(333, 200, generator=gen), torch.randn(3, 200, generator=gen)
    packed = gemv.pack(weight)
    whole = gemv.product(x, packed, 333)
    rows, cols = torch.randint(0, 3, (50,), generator=gen), torch.randint(0, 333, (50,), generator=gen)
    assert torch.equal(gemv.pick(x, packed, rows, cols), whole[rows, cols])


def close_call_model():
    """A tiny Llama whose lm_head has rows 3, 5 and 9 nearly or exactly alike: hidden states
    along row 3 make them a near tie (5) and an exact tie (9, where the first index wins)."""
    model = tiny_model("llama", vocab_size=200, tie_word_embeddings=False)
    w = model.lm_head.weight
    with torch.no_grad():
        w[5] = w[3] * (1 + 1e-3 * torch.randn(w.shape[1], generator=torch.Generator().manual_seed(1)))
        w[9] = w[3]
    return model


def hidden_rows(model, n=40):
    gen = torch.Generator().manual_seed(2)
    w = model.lm_head.weight
    rows = [torch.randn(w.shape[1], generator=gen) * scale for scale in (0.1, 1.0, 10.0) for _ in range(n // 4)]
    rows += [w[3] * 5 + 0.01 * torch.randn(w.shape[1], generator=gen) for _ in range(n - len(rows))]
    return torch.stack(rows)


DOT = [False, True] if gemv.dot_available() else [False]  # the bfloat16 dot products where this CPU has them


def test_each_screen_products_error_is_within_its_bound():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(500, 201, generator=gen) * torch.rand(500, 1, generator=gen) * 3
    x = torch.randn(16, 201, generator=gen) * torch.tensor([0.01, 1.0, 100.0, 1.0] * 4)[:, None]
    exact = gemv.product(x, gemv.pack(weight), 500)
    for dot in DOT:
        got = gemv.dot_product(x, gemv.pack_dot(weight), 500) if dot else gemv.product(x, gemv.pack(weight.bfloat16()), 500)
        bound = weight.norm(dim=1)[None] * x.norm(dim=1)[:, None] * screen.bound_factor(201, dot) + screen.TINY
        assert bool(((got - exact).abs() <= bound).all()), dot
        assert float((got - exact).abs().max()) > 0  # a real approximation, not the float32 product


@pytest.mark.parametrize("dot", DOT)
def test_screened_rows_have_the_whole_products_argmax_and_values(dot):
    model = close_call_model()
    vocab_screen = screen.VocabScreen(model.lm_head, dot=dot)
    x = hidden_rows(model)
    candidates = []
    with torch.inference_mode(), PackedLinears(model, kernels="gemv"):
        whole = kv.lm_logits(model, x).float()
        for at in range(0, x.shape[0], 3):  # passes of 3 rows
            got = vocab_screen.logits(model, x[at:at + 3])
            kept = torch.isfinite(got)
            assert torch.equal(got.argmax(-1), whole[at:at + 3].argmax(-1))
            assert torch.equal(got[kept], whole[at:at + 3][kept])  # the candidates' float32 bits
            candidates += kept.sum(-1).tolist()
    assert max(candidates) < model.config.vocab_size  # it screened
    assert max(candidates) >= 3  # the close calls kept every contender
    assert set(whole.argmax(-1).tolist()) & {3}  # ... and the exact tie went to the first index


@pytest.mark.parametrize("dot", DOT)
def test_what_it_cannot_screen_gets_the_whole_product(dot):
    model = close_call_model()
    vocab_screen = screen.VocabScreen(model.lm_head, dot=dot)
    x = hidden_rows(model)[:vocab_screen.max_rows + 1]
    with torch.inference_mode():
        outside = vocab_screen.logits(model, x[:2])  # no kernel scope: the lm_head runs torch's kernel
        assert torch.equal(outside, kv.lm_logits(model, x[:2]).float())
        with PackedLinears(model, kernels="gemv"):
            whole = kv.lm_logits(model, x).float()
            assert torch.equal(vocab_screen.logits(model, x), whole)  # more rows than it screens
            nan = x[:2].clone()
            nan[1, 0] = float("nan")
            assert torch.equal(vocab_screen.logits(model, nan).isnan(), kv.lm_logits(model, nan).isnan())
        with PackedLinears(model, kernels="gemv", stock_rows=3):  # a split: small passes on torch's kernel
            assert torch.equal(vocab_screen.logits(model, x[:2]), kv.lm_logits(model, x[:2]).float())


def test_where_the_screen_applies(monkeypatch):
    model = tiny_model("llama")
    assert isinstance(screen.for_model(model, "gemv"), screen.VocabScreen)
    assert screen.for_model(model, "default") is None and screen.for_model(model, "onednn") is None
    assert screen.for_model(tiny_model("gemma3"), "gemv") is None  # a softcap after the lm_head
    assert screen.for_model(tiny_model("llama").to(torch.bfloat16), "gemv") is None
    monkeypatch.setenv("MEDUSA_VOCAB_SCREEN", "0")
    assert screen.for_model(model, "gemv") is None


def counted(eng):
    """The passes the engine's screen was asked for: (rows, whether it screened them)."""
    calls = []
    real = eng.passes.screen.logits

    def logits(model, hidden):
        out = real(model, hidden)
        calls.append((hidden.shape[0], bool(torch.isinf(out).any())))
        return out

    eng.passes.screen.logits = logits
    return calls


@pytest.mark.parametrize("mode", ["baseline", "hybrid", "hybrid@eagle3"])
def test_greedy_decoding_screens_and_keeps_every_token(mode):
    """Each request's tokens, alone (whole trees, and trees cut to passes the screen takes) and
    scheduled beside others, are the target's greedy ones and those of the same engine without
    the screen; the screen ran."""
    model = tiny_model("llama")
    heads = {"hybrid": lambda: init_heads_for(model, num_heads=3),
             "hybrid@eagle3": lambda: init_eagle3_for(model, 3)}.get(mode, lambda: None)()
    eng = Engine(model, heads=heads, plan=Plan(kernels="gemv"))
    calls = counted(eng)
    run = mode.split("@")[0]
    prompts = [[5, 17, 33, 9, 41, 12], [9, 8, 7] * 7, list(range(10, 40))]
    got = [eng.generate(p, max_new_tokens=20, mode=run).tokens for p in prompts]
    cut = [eng.generate(p, max_new_tokens=20, mode=run, max_draft=2).tokens for p in prompts]
    assert cut == got
    assert any(screened for _, screened in calls)
    assert all(rows <= eng.passes.screen.max_rows for rows, screened in calls if screened)
    off = Engine(model, heads=heads, plan=Plan(kernels="gemv"))
    off.passes.screen = None
    for p, tokens in zip(prompts, got):
        assert tokens == off.generate(p, max_new_tokens=20, mode=run).tokens
        assert tokens == hf_greedy(model, p, 20)[:len(tokens)]
    sched = Scheduler(eng, max_batch=3, row_budget=4).start()
    try:
        streams = [sched.submit(p, max_new_tokens=20, mode=run) for p in prompts]
        assert [[t for chunk in s for t in chunk] for s in streams] == got
    finally:
        sched.close(timeout=60)


def test_requests_that_read_more_than_argmaxes_are_not_screened():
    model = tiny_model("llama")
    eng = Engine(model, plan=Plan(kernels="gemv"))
    off = Engine(model, plan=Plan(kernels="gemv"))
    off.passes.screen = None
    calls = counted(eng)
    prompt = [5, 17, 33, 9, 41, 12]
    for kwargs in ({"temperature": 0.7, "seed": 3}, {"logprobs": 2}, {"penalties": Penalties(presence=0.5)}):
        got = eng.generate(prompt, max_new_tokens=12, mode="baseline", **kwargs)
        want = off.generate(prompt, max_new_tokens=12, mode="baseline", **kwargs)
        assert got.tokens == want.tokens and got.logprobs == want.logprobs, kwargs
    assert not calls
    eng.generate(prompt, max_new_tokens=4, mode="baseline")
    assert calls  # the same engine screens a greedy request
