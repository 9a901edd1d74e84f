"""A batch's sequences draft together (medusa/decoding/proposers/shared.py): each round of their
EAGLE or EAGLE-3 heads' calls runs as one C layer call over every sequence's rows, Medusa heads'
top-k as one call over every sequence's hidden state, block heads' drafter passes as one pass
over every sequence's block, and every sequence drafts the very trees it
drafts alone (so takes the same steps to the same tokens)."""

from __future__ import annotations

import pytest
import torch
from tiny import DRAFTING, hf_greedy, tiny_model
from tiny_heads import random_heads

from medusa.autotune.planner import adopt_draft_dtype
from medusa.decoding.batch import Batch
from medusa.decoding.engine import Engine
from medusa.decoding.generation import Failed, Tokens
from medusa.decoding.plan import Plan
from medusa.decoding.proposers import shared
from medusa.decoding.proposers.block import BlockProposer
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.request import make_request
from medusa.decoding.run import Decoding
from medusa.models.block_heads import BlockHeads, init_block_for
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.eagle_heads import init_eagle_for
from medusa.models.heads import MedusaHeads
from medusa.runtime import drafter
from medusa.runtime.kernels import PackedLinears

PROMPTS = [[5, 17, 33, 9, 41, 12], [9, 8, 7] * 7, list(range(10, 40))]
N = 20


def engine(kind: str) -> Engine:
    model = tiny_model("llama")
    # heads that start as the target's own rows or last layer: their drafts are often right
    heads = init_eagle3_for(model, 3) if kind == "eagle3" else init_eagle_for(model, 3)
    size = DynamicTree(nodes=6, depth=3, topk=2)
    return Engine(model, heads=heads, plan=Plan(kernels="gemv", eagle=size, hybrid=size), proposer_config=DRAFTING)


def record_proposals(monkeypatch) -> dict[int, list[list[int]]]:
    """Each decoding's proposals (their tokens), step by step, keyed by the decoding."""
    seen: dict[int, list[list[int]]] = {}
    held: list[Decoding] = []  # (alive while watched: a freed decoding's id could name the next one)
    steps = Decoding.propose_steps

    def watched(self, rows_cap=None):
        proposal = yield from steps(self, rows_cap)
        if proposal is not None:
            if id(self) not in seen:
                held.append(self)
            seen.setdefault(id(self), []).append(proposal.tokens.tolist())
        return proposal

    monkeypatch.setattr(Decoding, "propose_steps", watched)
    return seen


def batched(eng: Engine, runs: list[Decoding]) -> tuple[list[list[int]], list[Failed]]:
    """``runs`` prefilled, then decoded in one batch (each drafts its whole proposal)."""
    batch, tokens, failed = Batch(eng.passes, eng.max_rows), {id(r): [] for r in runs}, []
    with eng.owned():
        for run in runs:
            batch.add(run)
            while run not in batch.running:
                for r, event in batch.prefill()[1]:
                    tokens[id(r)] += event.ids if isinstance(event, Tokens) else []
        while batch:
            for r, event in batch.step().events:
                if isinstance(event, Tokens):
                    tokens[id(r)] += event.ids
                elif isinstance(event, Failed):
                    failed.append(event)
    return [tokens[id(r)] for r in runs], failed


def greedy(eng: Engine, prompt: list[int], tokens: list[int]) -> bool:
    """``tokens`` are the target's greedy continuation (transformers' ``generate`` stops at EOS;
    these requests ignore it)."""
    ref = hf_greedy(eng.model, prompt, N)
    return len(tokens) == N and tokens[:len(ref)] == ref


def decodings(eng: Engine, mode: str) -> list[Decoding]:
    return [eng.decoding(make_request(p, max_new_tokens=N, mode=mode, ignore_eos=True)) for p in PROMPTS]


def shared_calls(monkeypatch, fail=None) -> list[int]:
    """How many sequences each C layer call ran (``fail(calls)``: raise in it instead)."""
    segments: list[int] = []
    step_many = drafter.step_many

    def counted(heads, t, calls):
        segments.append(len(calls))
        if fail is not None and fail(calls):
            raise RuntimeError("this call broke")
        return step_many(heads, t, calls)

    monkeypatch.setattr(drafter, "step_many", counted)
    return segments


@pytest.mark.parametrize("kind, mode", [("eagle3", "eagle3"), ("eagle3", "hybrid"), ("eagle", "eagle")])
def test_a_batch_drafts_in_one_layer_call_a_round_and_the_trees_each_drafts_alone(monkeypatch, kind, mode):
    segments, _ = alone_then_together(monkeypatch, engine(kind), mode, lambda: shared_calls(monkeypatch))
    assert max(segments) == len(PROMPTS)  # the three sequences' rows in one call


def alone_then_together(monkeypatch, eng: Engine, mode: str, count) -> tuple[list[int], list]:
    """Each prompt decoded alone, then all three in one batch: the same tokens (the target's
    greedy ones) and the same proposals step for step. Returns what ``count()`` (called before
    the batch) recorded, and the proposals."""
    seen = record_proposals(monkeypatch)
    alone = [eng.generate(p, max_new_tokens=N, mode=mode, ignore_eos=True).tokens for p in PROMPTS]
    alone_trees = list(seen.values())
    seen.clear()
    counted = count()
    runs = decodings(eng, mode)
    tokens, failed = batched(eng, runs)
    assert not failed
    for prompt, got, want in zip(PROMPTS, tokens, alone):
        assert got == want and greedy(eng, prompt, got)
    assert [seen[id(r)] for r in runs] == alone_trees  # tree for tree, step for step
    return counted, alone_trees


def test_a_failed_shared_call_is_undone_and_each_sequence_drafts_on_its_own(monkeypatch):
    """A shared call that raises: its pairs leave the caches, each sequence's call runs alone,
    and every request still gets its own tokens."""
    eng = engine("eagle3")
    segments = shared_calls(monkeypatch, fail=lambda calls: len(calls) > 1 and len(segments) % 3 == 0)
    tokens, failed = batched(eng, decodings(eng, "eagle3"))
    assert not failed and segments.count(1) >= 2  # the broken calls were redone one sequence at a time
    for prompt, got in zip(PROMPTS, tokens):
        assert greedy(eng, prompt, got)


def test_a_sequence_whose_drafting_fails_ends_alone(monkeypatch):
    """One sequence's heads call raises inside the shared round: that request fails, the others
    draft on without it and finish with their own tokens."""
    eng = engine("eagle3")
    runs = decodings(eng, "eagle3")
    # its heads' calls fail once its prompt's pairs are in (they go in alone, before the batch steps)
    shared_calls(monkeypatch, fail=lambda calls: any(c[3] is runs[1].proposer.cache and c[3].length for c in calls))
    tokens, failed = batched(eng, runs)
    assert len(failed) == 1 and "this call broke" in str(failed[0].error)
    for i in (0, 2):
        assert greedy(eng, PROMPTS[i], tokens[i])


def test_together_returns_each_coroutines_error_alone():
    def fine(x):
        yield from ()
        return x

    def broken():
        raise ValueError("drafting broke")
        yield

    results = shared.together([fine(1), broken(), fine(3)])
    assert results[0] == 1 and results[2] == 3 and isinstance(results[1], ValueError)


MEDUSA_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def medusa_engine(kernels: str = "gemv") -> Engine:
    model = tiny_model("llama")
    heads = random_heads(model, seed=3)
    heads.set_draft_vocab(list(range(0, 96, 2)) + [1, 3, 5, 7, 9, 17])
    adopt_draft_dtype(heads, "bfloat16")  # as the shipped Medusa heads draft beside a float32 target
    return Engine(model, heads=heads, tree=MEDUSA_TREE, plan=Plan(kernels=kernels), proposer_config=DRAFTING)


def block_engine(kernels: str = "gemv") -> Engine:
    model = tiny_model("llama")
    torch.manual_seed(1)
    heads = init_block_for(model, 4, vocab=torch.arange(0, 96, 3))
    size = DynamicTree(nodes=7, depth=4, topk=2)
    return Engine(model, heads=heads, plan=Plan(kernels=kernels, eagle=size, hybrid=size), proposer_config=DRAFTING)


# each kind whose heads answer a batch in one call: its engine, and the call (heads class, method)
ONE_CALL = {"medusa": (medusa_engine, MedusaHeads, "topk_many"), "block": (block_engine, BlockHeads, "draft_many")}


def shared_counts(monkeypatch, kind: str, fail=None) -> list[int]:
    """How many sequences each shared call of ``kind``'s heads ran (``fail(inputs)``: raise in it)."""
    _, cls, name = ONE_CALL[kind]
    sizes: list[int] = []
    call = getattr(cls, name)

    def counted(self, inputs, *args):
        sizes.append(inputs.shape[0])
        if fail is not None and fail(inputs):
            raise RuntimeError("this call broke")
        return call(self, inputs, *args)

    monkeypatch.setattr(cls, name, counted)
    return sizes


@pytest.mark.parametrize("kind, mode", [("medusa", "medusa"), ("medusa", "hybrid"), ("block", "block"),
                                        ("block", "hybrid")])
def test_medusa_and_block_heads_answer_a_batch_in_one_call_and_draft_the_trees_each_drafts_alone(
        monkeypatch, kind, mode):
    sizes, alone_trees = alone_then_together(monkeypatch, ONE_CALL[kind][0](), mode,
                                             lambda: shared_counts(monkeypatch, kind))
    assert max(sizes) == len(PROMPTS)  # the three sequences' heads in one call
    assert any(len(tree) > 1 for trees in alone_trees for tree in trees)  # the heads drafted


def test_medusa_top_k_of_many_rows_is_each_rows_own_on_the_gemv_kernels():
    eng = medusa_engine()
    heads, hidden = eng.heads, torch.randn(5, eng.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with eng.kernel_scope(), torch.inference_mode():
        assert heads.shares_rows()
        together = heads.logits(hidden, range(3), heads.draft_vocab)  # [3, 5, S]
        for i in range(5):
            assert torch.equal(together[:, i], heads.logits(hidden[i], range(3), heads.draft_vocab))
        assert torch.equal(heads.topk_many(hidden, 2, 3), torch.stack([heads.topk(h, 2, num_heads=3) for h in hidden]))
    with torch.inference_mode():  # outside the scope: torch's product, the same scores to rounding
        assert not heads.shares_rows()
        torch.testing.assert_close(heads.logits(hidden, range(3), heads.draft_vocab).float(), together.float(),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["medusa", "block"])
def test_off_the_gemv_kernels_each_sequences_heads_run_alone(monkeypatch, kind):
    """Where a product's rows may round differently together (torch's kernels), each sequence's
    heads run on their own: the same tokens, no shared call."""
    eng = ONE_CALL[kind][0](kernels="default")
    sizes = shared_counts(monkeypatch, kind)
    tokens, failed = batched(eng, decodings(eng, kind))
    assert not failed and sizes == []
    for prompt, got in zip(PROMPTS, tokens):
        assert greedy(eng, prompt, got)


@pytest.mark.parametrize("kind", ["medusa", "block"])
def test_a_failed_shared_call_runs_each_sequences_heads_alone(monkeypatch, kind):
    eng = ONE_CALL[kind][0]()
    sizes = shared_counts(monkeypatch, kind, fail=lambda inputs: len(sizes) % 2 == 1)
    tokens, failed = batched(eng, decodings(eng, kind))
    assert not failed and len(sizes) >= 2  # every other shared call broke and was redone one by one
    for prompt, got in zip(PROMPTS, tokens):
        assert greedy(eng, prompt, got)


@pytest.mark.parametrize("kind", ["medusa", "block"])
def test_a_sequence_whose_own_heads_call_fails_ends_alone(monkeypatch, kind):
    eng = ONE_CALL[kind][0]()
    runs = decodings(eng, kind)
    shared_counts(monkeypatch, kind, fail=lambda inputs: True)  # so each sequence's heads run on their own
    if kind == "medusa":  # its top-k, told apart by its hidden state
        single = MedusaHeads.topk

        def own(self, hidden, k, num_heads=None):
            if runs[1].state is not None and torch.equal(hidden, runs[1].state.hidden):
                raise RuntimeError("its heads broke")
            return single(self, hidden, k, num_heads=num_heads)

        monkeypatch.setattr(MedusaHeads, "topk", own)
    else:  # its drafter pass, told apart by its proposer
        logits = BlockProposer._logits

        def own(self, root, position, depth=None):
            if self is runs[1].proposer:
                raise RuntimeError("its heads broke")
            return logits(self, root, position, depth)

        monkeypatch.setattr(BlockProposer, "_logits", own)
    tokens, failed = batched(eng, runs)
    assert len(failed) == 1 and "its heads broke" in str(failed[0].error)
    for i in (0, 2):
        assert greedy(eng, PROMPTS[i], tokens[i])


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_draft_scores_that_train_stay_on_torchs_product(kind):
    """The gemv kernels have no backward: with the target's products on them and gradients on (a
    training loss), the heads' draft scores run torch's product, and the gradient reaches what they
    score; with gradients off (drafting) they run the kernels."""
    model = tiny_model("llama")
    heads = random_heads(model, seed=3) if kind == "medusa" else init_eagle_for(model, 3)
    heads.set_draft_vocab(list(range(0, 96, 2)))
    hidden = torch.randn(2, model.config.hidden_size, requires_grad=True)
    with PackedLinears(model, kernels="gemv"):
        heads.logits(hidden, vocab=heads.draft_vocab).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
