"""What a CUDA device changes, checked without one.

A draft vocabulary lives on the device of the projection whose top-k it translates: a copy left
on the CPU beside a CUDA target failed the first eagle step on an H200 ("indices should be either
on cpu or on the same device as the indexed tensor"); the meta device stands in here for any
device other than the CPU. The default heads follow the device type (docs/benchmarks/2026-11-26-h200.md#eager-passes)."""

import pytest
import torch
from test_eagle import noisy_eagle
from tiny import tiny_model
from tiny_heads import random_heads

from medusa.api import SHIPPED_EAGLE3_HEADS, SHIPPED_EAGLE_HEADS, SHIPPED_HEADS, shipped_heads_for
from medusa.decoding.proposers import shared
from medusa.decoding.proposers.eagle import DynamicTree, EagleProposer
from medusa.models.eagle_heads import EagleHeads
from medusa.models.heads_config import HeadsConfig

IDS = [9, 1, 5, 1]


def test_medusa_draft_vocab_is_made_on_the_projection_device():
    model = tiny_model("llama")
    heads = random_heads(model)
    heads.set_draft_vocab(IDS)
    assert heads.draft_vocab.tolist() == [1, 5, 9]  # sorted, unique, on the CPU beside a CPU target
    model.to("meta")
    heads.to("meta")
    heads.set_draft_vocab(IDS)
    assert heads.draft_vocab.device.type == "meta"


def test_eagle_draft_vocab_is_made_on_the_target_device():
    model = tiny_model("llama")
    eagle = noisy_eagle(model)
    eagle.set_draft_vocab(IDS)
    assert eagle.draft_vocab.tolist() == [1, 5, 9]
    model.to("meta")
    eagle.to("meta")
    eagle.set_draft_vocab(IDS)
    assert eagle.draft_vocab.device.type == "meta"
    assert eagle.logits(torch.zeros(2, model.config.hidden_size, device="meta"), eagle.draft_vocab).shape == (2, 3)


@pytest.mark.filterwarnings("ignore:for .*meta parameter:UserWarning")  # the meta layer's no-op load
def test_eagle1_warm_start_runs_the_target_norms_where_they_live():
    # init_eagle_for builds the head on the CPU and warm-starts it before moving it: beside a CUDA
    # target the eagle1 fold fed the target's norms a row of ones made on the head's device
    model = tiny_model("llama")
    vocab, hidden = model.get_output_embeddings().weight.shape
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=2, kind="eagle", eagle_layout="eagle1")
    heads = EagleHeads(config, model).to("meta")  # the head on another device than the target
    heads.init_from_target()
    assert heads.layer.self_attn.q_proj.weight.device.type == "meta"


def test_default_heads_are_the_kind_measured_fastest_on_the_device_type():
    for folder in (SHIPPED_EAGLE3_HEADS, SHIPPED_EAGLE_HEADS, SHIPPED_HEADS):
        assert (folder / "config.json").is_file(), folder
    assert shipped_heads_for(torch.device("cpu")) == SHIPPED_EAGLE3_HEADS
    assert shipped_heads_for(torch.device("cuda", 0)) == SHIPPED_HEADS


def test_eagle_drafting_reads_nothing_back_until_every_level_is_queued():
    # A read from the device (.tolist(), .item(), a tensor as a Python bool) makes a GPU wait
    # for the work queued so far; on the meta device it raises instead. The tree's growth
    # (medusa/decoding/proposers/eagle.py: EagleProposer._draft) must queue every level without one.
    model = tiny_model("llama")
    heads = noisy_eagle(model)
    heads.set_draft_vocab(list(range(0, model.config.vocab_size, 2)))
    model.to("meta")
    heads.to("meta")
    proposer = EagleProposer(heads, torch.device("meta"), DynamicTree(nodes=9, depth=4, topk=3))
    proposer.last = torch.empty(model.config.hidden_size, device="meta")
    parents, tokens, scores = shared.alone(proposer._draft(root=0, depth=4))
    assert [p.shape for p in parents] == [(3,)] * 3
    assert [t.shape for t in tokens] == [(3,), (9,), (9,), (9,)] and [s.shape for s in scores] == [(3,), (9,), (9,), (9,)]
    assert proposer.cache.get_seq_length() == 9  # three expanded levels of three pairs
