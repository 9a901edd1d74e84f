import json

import pytest
import torch
from tiny import DRAFTING, tiny_model

from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads
from medusa.models.heads_config import HeadsConfig, save_heads
from medusa.models.loader import init_heads_for, load_heads


def perturbed(heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return heads


def test_fresh_heads_start_as_the_targets_next_token_predictor():
    model = tiny_model("llama")
    heads = init_heads_for(model, num_heads=3)
    h = torch.randn(5, 64)
    logits = heads(h)  # [K, 5, V]
    assert logits.shape == (3, 5, 96)
    for k in range(3):
        torch.testing.assert_close(logits[k], model.lm_head(h))


def test_parameter_count_grows_with_layers_and_blocks_are_distinct():
    model = tiny_model("llama")
    counts = [sum(p.numel() for p in init_heads_for(model, num_heads=2, num_layers=n).parameters()) for n in (1, 2, 3)]
    h = 64
    assert counts == [2 * n * (h * h + h) for n in (1, 2, 3)]
    heads = init_heads_for(model, num_heads=2, num_layers=3)
    blocks = [b for head in heads.blocks for b in head]
    assert len({id(b) for b in blocks}) == 6  # no module shared between layers or heads


def test_shared_projection_is_not_a_parameter_of_the_heads():
    model = tiny_model("llama")
    heads = init_heads_for(model, num_heads=2)
    assert all("lm_head" not in n and "proj" not in n for n, _ in heads.named_parameters())
    assert not any(p is model.lm_head.weight for p in heads.parameters())


@pytest.mark.parametrize("projection", ["shared", "per_head"])
def test_save_load_round_trip(tmp_path, projection):
    model = tiny_model("qwen2")
    heads = perturbed(init_heads_for(model, num_heads=3, num_layers=2, projection=projection))
    folder = save_heads(heads, tmp_path / "heads")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "medusa_heads" and config["num_heads"] == 3 and config["num_layers"] == 2
    assert config["hidden_size"] == 64 and config["vocab_size"] == 96 and config["projection"] == projection
    loaded = load_heads(folder, model)
    h = torch.randn(4, 64)
    torch.testing.assert_close(loaded(h), heads(h))
    prompt = [4, 8, 15, 16, 23, 42]
    a = Engine(model, heads=heads, tree=[(0,), (1,), (0, 0)], proposer_config=DRAFTING).generate(prompt, max_new_tokens=12)
    b = Engine(model, heads=loaded, tree=[(0,), (1,), (0, 0)], proposer_config=DRAFTING).generate(prompt, max_new_tokens=12)
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted


def test_overwriting_a_heads_folder_keeps_other_files(tmp_path):
    model = tiny_model("llama")
    folder = save_heads(init_heads_for(model), tmp_path / "h")
    (folder / "README.md").write_text("card")
    save_heads(perturbed(init_heads_for(model)), folder)
    assert (folder / "README.md").read_text() == "card"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folders left


def test_heads_for_another_model_are_a_clear_error(tmp_path):
    small = tiny_model("llama")
    folder = save_heads(init_heads_for(small), tmp_path / "h")
    other = tiny_model("llama", vocab_size=128)
    with pytest.raises(MedusaError, match="made for hidden size 64 and vocab 96.*vocab 128"):
        load_heads(folder, other)
    with pytest.raises(MedusaError, match="not a heads folder"):
        load_heads(tmp_path, small)


def test_bad_configs():
    with pytest.raises(MedusaError, match="projection"):
        HeadsConfig(hidden_size=8, vocab_size=8, projection="tied")
    with pytest.raises(MedusaError, match="num_heads"):
        HeadsConfig(hidden_size=8, vocab_size=8, num_heads=0)
    unbound = MedusaHeads(HeadsConfig(hidden_size=8, vocab_size=8))
    with pytest.raises(MedusaError, match="not bound"):
        unbound(torch.randn(8))


@pytest.mark.parametrize("projection", ["shared", "per_head"])
def test_draft_vocab_restricts_topk_to_the_subset(projection):
    model = tiny_model("llama")
    heads = perturbed(init_heads_for(model, num_heads=3, projection=projection), seed=3)
    h = torch.randn(64)
    full = heads.topk(h, 4)
    # A subset containing every head's full top-4 gives the same answer ...
    heads.set_draft_vocab(torch.cat([full.flatten(), torch.arange(50, 60)]))
    torch.testing.assert_close(heads.topk(h, 4), full)
    # ... and a subset without them only ever proposes its own ids, in score order.
    subset = torch.tensor([i for i in range(96) if i not in set(full.flatten().tolist())])
    heads.set_draft_vocab(subset)
    top = heads.topk(h, 4)
    assert set(top.flatten().tolist()) <= set(subset.tolist())
    logits = heads(h)  # [K, V]
    for k in range(3):
        assert top[k].tolist() == subset[logits[k, subset].topk(4).indices].tolist()
    with pytest.raises(MedusaError, match="draft vocabulary"):
        heads.set_draft_vocab([0, 96])
