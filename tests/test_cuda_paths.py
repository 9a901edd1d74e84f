"""What a CUDA device changes, checked without one.

A draft vocabulary lives on the device of the projection whose top-k it translates: a copy left
on the CPU beside a CUDA target failed the first eagle step on an H200 ("indices should be either
on cpu or on the same device as the indexed tensor"); the meta device stands in here for any
device other than the CPU. The default heads follow the device type (README "On a GPU")."""

import torch
from test_eagle import noisy_eagle
from tiny import tiny_model
from tiny_heads import random_heads

from medusa.api import SHIPPED_EAGLE_HEADS, SHIPPED_HEADS, shipped_heads_for

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


def test_default_heads_are_the_kind_measured_fastest_on_the_device_type():
    assert (SHIPPED_EAGLE_HEADS / "config.json").is_file() and (SHIPPED_HEADS / "config.json").is_file()
    assert shipped_heads_for(torch.device("cpu")) == SHIPPED_EAGLE_HEADS
    assert shipped_heads_for(torch.device("cuda", 0)) == SHIPPED_HEADS
