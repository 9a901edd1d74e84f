"""Head losses: the shift (head k at t -> token t+k+2, teacher at t+k+1), CE, KL, subsets."""

import torch
import torch.nn.functional as F

from medusa.models.heads import MedusaHeads
from medusa.models.heads_config import HeadsConfig
from medusa.training.losses import (
    IGNORE,
    frequent_tokens,
    head_weights,
    heads_loss,
    lm_distill_loss,
    shift_targets,
    soft_cross_entropy,
)


def _heads(vocab=11, hidden=8, num_heads=3, seed=0):
    torch.manual_seed(seed)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    heads = MedusaHeads(HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads), lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    return heads


def test_shift_aligns_labels_and_teacher_positions():
    tokens = torch.arange(10, 20).reshape(1, 10)  # token at position j is 10 + j
    mask = torch.ones_like(tokens)
    mask[0, 6] = 0
    t_ids = (torch.arange(10) * 100).reshape(1, 10, 1)  # teacher row j marked as 100*j
    t_logp = torch.zeros(1, 10, 1)
    tg = shift_targets(tokens, mask, 3, t_ids, t_logp)
    for k in range(3):
        for t in range(10):
            j = t + k + 2
            if j < 10 and j != 6:
                assert tg.valid[k, t] and tg.labels[k, t] == 10 + j
                assert tg.teacher_ids[k, t, 0] == 100 * (j - 1)  # the target's distribution over token j
            else:
                assert not tg.valid[k, t] and tg.labels[k, t] == IGNORE


def test_ce_matches_cross_entropy_per_head():
    heads = _heads()
    hidden = torch.randn(2 * 7, 8)
    tokens = torch.randint(0, 11, (2, 7))
    tg = shift_targets(tokens, torch.ones_like(tokens), 3)
    weights = [1.0, 0.5, 0.25]
    loss, counts = heads_loss(heads, hidden, tg, weights, distill=0.0)
    expected = 0
    for k in range(3):
        rows = tg.valid[k]
        expected += weights[k] * F.cross_entropy(heads.logits(hidden[rows], [k])[0].float(), tg.labels[k, rows])
    assert torch.allclose(loss, expected, atol=1e-5)
    assert counts["n"].tolist() == [2 * 5, 2 * 4, 2 * 3]
    assert (counts["top1"] <= counts["top5"]).all()


def test_kl_is_zero_when_the_head_matches_the_teacher_and_positive_otherwise():
    logp = torch.log_softmax(torch.randn(4, 50), -1)
    top, ids = logp.topk(50, -1)  # a full-vocabulary "top-k": the teacher is the student
    kl, p = soft_cross_entropy(logp, ids, top)
    assert torch.allclose(kl, torch.zeros(4), atol=1e-5)
    assert torch.allclose(p.sum(-1), torch.ones(4))
    other = torch.log_softmax(torch.randn(4, 50), -1)
    assert (soft_cross_entropy(other, ids, top)[0] > 0).all()


def test_distillation_gradient_moves_heads_towards_teacher():
    heads = _heads(seed=1)
    hidden = torch.randn(30, 8)
    tokens = torch.randint(0, 11, (1, 30))
    teacher = torch.log_softmax(torch.randn(1, 30, 11) * 3, -1)
    top, ids = teacher.topk(5, -1)
    tg = shift_targets(tokens, torch.ones_like(tokens), 3, ids, top)
    opt = torch.optim.Adam(heads.parameters(), lr=0.05)
    first = None
    for _ in range(60):
        loss, _ = heads_loss(heads, hidden, tg, head_weights(3), distill=1.0)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first


def test_vocab_subset_counts_outside_targets_as_misses():
    heads = _heads(vocab=20)
    hidden = torch.randn(12, 8)
    tokens = torch.randint(0, 20, (1, 12))
    tg = shift_targets(tokens, torch.ones_like(tokens), 3)
    vocab = torch.arange(0, 20, 2)  # even ids only
    loss, counts = heads_loss(heads, hidden, tg, [1, 1, 1], distill=0.0, vocab=vocab)
    assert torch.isfinite(loss)
    for k in range(3):
        rows = tg.valid[k]
        labels = tg.labels[k, rows]
        pred = vocab[heads.logits(hidden[rows], [k], vocab)[0].argmax(-1)]
        assert counts["top1"][k] == (pred == labels).sum()  # odd labels can never be hit
    assert heads.logits(hidden, [0], vocab)[0].shape == (12, 10)


def test_frequent_tokens_and_weights():
    ids = torch.tensor([5, 5, 5, 2, 2, 9])
    assert frequent_tokens(ids, 2, 10).tolist() == [2, 5]
    assert frequent_tokens(ids, 5, 10).tolist() == [0, 1, 2, 5, 9]  # unseen ids: the lowest
    fill = torch.tensor([7, 7, 7, 7, 1, 1, 5, 5, 5, 5, 5, 5, 5])
    assert frequent_tokens(ids, 5, 10, fill).tolist() == [1, 2, 5, 7, 9]  # the data's ids, then the fill's
    assert frequent_tokens(ids, 3, 10, fill).tolist() == [2, 5, 9]  # a data id outranks any fill id
    assert head_weights(3, 0.5) == [1.0, 0.5, 0.25]
    assert head_weights(2, 0.5, [0.3, 0.7]) == [0.3, 0.7]


def test_lm_distill_loss_zero_for_identical_logits():
    x = torch.randn(6, 30)
    assert lm_distill_loss(x, x).abs() < 1e-6
    assert lm_distill_loss(x + torch.randn(6, 30), x) > 0
