"""Block heads (kind: block): what a block sees, the decoding contract, training, the cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from tiny import tiny_model
from train_fixtures import tiny_target, write_counting_data
from transformers import AutoModelForCausalLM

from medusa.config import from_dict
from medusa.errors import MedusaError
from medusa.models.block_heads import BlockHeads, init_block_for
from medusa.models.eagle3_heads import init_eagle3_for
from medusa.models.heads_config import HeadsConfig, read_heads_config, save_heads
from medusa.models.loader import load_heads
from medusa.training.block_train import block_loss, block_weights, sample_anchors
from medusa.training.checkpoints import latest_checkpoint
from medusa.training.eagle3_ttt import target_outputs
from medusa.training.loop import TrainConfig, train


def blocks(arch: str = "llama", num_layers: int = 2, k: int = 4, seed: int = 0):
    model = tiny_model(arch)
    torch.manual_seed(seed)
    heads = init_block_for(model, k, vocab=torch.arange(10, 60), feature_layers=[0, 1], num_layers=num_layers)
    with torch.no_grad():  # away from the initialisation, so every part of the wiring matters
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, heads


def inputs(heads: BlockHeads, b: int = 2, t: int = 20, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, t, 2 * heads.config.hidden_size, generator=g)
    return feats, torch.randint(3, 96, (b, t), generator=g)


def test_a_block_sees_its_context_up_to_its_anchor_and_its_own_rows_only():
    _, heads = blocks()
    feats, ids = inputs(heads)
    anchors = torch.tensor([[3, 9, 14], [2, 7, 11]])
    with torch.no_grad():
        base = heads.train_logits(heads.fuse(feats), ids, anchors)  # [B, A, k, S]
        assert base.shape == (2, 3, 4, 50)

        def changed(f=None, i=None):
            return (heads.train_logits(heads.fuse(feats if f is None else f), ids if i is None else i, anchors)
                    - base).abs().amax(dim=(2, 3))[0]  # [A] for sequence 0

        later = feats.clone()
        later[0, 10:] += 3.0  # after block 1's t = 9
        assert changed(f=later).tolist()[:2] == [0.0, 0.0] and changed(f=later)[2] > 1e-3
        at_t = feats.clone()
        at_t[0, 9] += 3.0  # block 1's own t is context
        assert changed(f=at_t)[0] == 0 and changed(f=at_t)[1] > 1e-3 and changed(f=at_t)[2] > 1e-3
        root = ids.clone()
        root[0, 15] = (root[0, 15] + 1) % 96  # block 2's root token: no other block sees it
        assert changed(i=root)[:2].tolist() == [0.0, 0.0] and changed(i=root)[2] > 1e-3
        root = ids.clone()
        root[0, 4] = (root[0, 4] + 1) % 96  # block 0's root: the later blocks' context is features only
        assert changed(i=root)[0] > 1e-3 and changed(i=root)[1:].tolist() == [0.0, 0.0]
        other = ids.clone()
        other[0, 12] = (other[0, 12] + 1) % 96  # a token no block holds: features carry the context
        assert changed(i=other).abs().max() == 0


@pytest.mark.parametrize("arch,num_layers", [("llama", 1), ("llama", 2), ("gemma3", 2)])
def test_draft_from_a_fixed_buffer_equals_train_logits_of_the_last_block(arch, num_layers):
    # The decoding contract: context keys computed once per verified position, kept in a
    # fixed-capacity buffer whose unused slots hold anything, masked by ctx_valid.
    _, heads = blocks(arch, num_layers)
    feats, ids = inputs(heads, t=14)
    t = ids.shape[1] - 2  # the last block: its root x_{t+1} is the last token
    with torch.no_grad():
        fused = heads.fuse(feats)
        want = heads.train_logits(fused, ids, torch.tensor([[t], [t]]))[:, 0]  # [B, k, S]
        capacity = 24
        buffer = torch.cat([fused, torch.randn(2, capacity - fused.shape[1], fused.shape[2])], dim=1)
        ctx = heads.context_kv(buffer, torch.arange(capacity).expand(2, capacity))
        valid = (torch.arange(capacity) <= t).expand(2, capacity)
        got = heads.draft(ids[:, t + 1], torch.full((2,), t + 1), ctx, valid)
        assert got.shape == (2, heads.block_size, 50)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        exact = heads.context_kv(fused[:, : t + 1], torch.arange(t + 1).expand(2, t + 1))
        assert torch.allclose(heads.draft(ids[:, t + 1], torch.full((2,), t + 1), exact, None), want, atol=1e-5)
        shifted = heads.draft(ids[:, t + 1], torch.full((2,), t + 3), ctx, valid)  # rotary: positions matter
        assert (shifted - want).abs().max() > 1e-4
    assert len(ctx) == num_layers and ctx[0][0].shape == (2, heads.layer_config.num_key_value_heads, capacity,
                                                          heads.layer_config.head_dim)
    assert torch.equal(heads.to_target(torch.tensor([0, 7, 49])), torch.tensor([10, 17, 59]))


def test_draft_traces_as_one_graph():
    # What a CUDA graph needs: no host sync, no branch on tensor values, fixed shapes. Dynamo's
    # fullgraph tracing fails on any of them (the eager backend: no compiler needed).
    _, heads = blocks("gemma3", 2)
    feats, ids = inputs(heads, t=14)
    with torch.no_grad():
        ctx = heads.context_kv(heads.fuse(feats), torch.arange(14).expand(2, 14))
        valid = (torch.arange(14) <= torch.tensor([[9], [12]])).expand(2, 14)
        args = (ids[:, 10], torch.tensor([10, 13]), ctx, valid)
        traced = torch.compile(heads.draft, fullgraph=True, backend="eager", dynamic=False)
        assert torch.allclose(traced(*args), heads.draft(*args), atol=1e-6)


def test_the_root_embedding_is_the_targets_own_with_gemmas_scale():
    model, heads = blocks("gemma3")
    ids = torch.tensor([[5, 9]])
    emb = model.get_input_embeddings()
    assert torch.allclose(heads._block_inputs(ids)[0, 0, 0], emb.weight[5] * emb.embed_scale, atol=1e-5)
    assert torch.equal(heads._block_inputs(ids)[0, 0, 1], heads.mask_embedding.detach())


def test_fused_features_are_the_configured_layers_inputs():
    model = tiny_model("gemma3")  # three layers: [2, 0] is neither the default nor in order
    heads = init_block_for(model, 4, feature_layers=[2, 0])
    ids = torch.tensor([[5, 17, 33, 9, 41, 12]])
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw, i=i: seen.__setitem__(i, (a[0] if a else kw["hidden_states"])[0]),
                                             with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        model.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    out = target_outputs(model, ids, torch.ones_like(ids), heads.feature_layers, 4)
    assert heads.feature_layers == (2, 0) and heads.fc.in_features == 2 * model.config.hidden_size
    assert torch.allclose(out["features"][0], torch.cat([seen[2], seen[0]], -1), atol=1e-5)


def test_anchors_are_answer_positions_whose_block_fits_and_the_draw_is_seeded():
    answer = torch.zeros(3, 30, dtype=torch.bool)
    answer[0, 10:30] = True
    answer[1, 5:12] = True  # length 12: t + 5 < 12 leaves t in 4..6
    lengths = torch.tensor([30, 12, 30])  # the third has no answer: nothing to draw
    ids = torch.arange(90).reshape(3, 30)
    anchors, ok = sample_anchors(answer, lengths, 4, 8, seed=1, tokens=ids)
    assert ok[0].all() and ok[1].sum() == 3 and not ok[2].any()
    assert set(anchors[1][ok[1]].tolist()) == {4, 5, 6}
    a0 = anchors[0].tolist()
    assert len(set(a0)) == 8 and all(9 <= t <= 24 for t in a0)
    again, _ = sample_anchors(answer, lengths, 4, 8, seed=1, tokens=ids)
    other, _ = sample_anchors(answer, lengths, 4, 8, seed=2, tokens=ids)
    assert torch.equal(again, anchors) and not torch.equal(other[0], anchors[0])
    assert block_weights(3, 2.0) == pytest.approx([1.0, 0.6065307, 0.3678794])


def test_block_loss_scores_each_position_against_the_target_there():
    model, heads = blocks("llama", 1)
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    attn = torch.ones_like(ids)
    attn[1, 12:] = 0
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone(),
             **target_outputs(model, ids, attn, heads.feature_layers, 8)}
    loss, counts = block_loss(heads, batch, block_weights(4, 4.0), anchors_per_seq=64)
    # every t with t + 5 < length and x_{t+1} in the answer: 11 + 7 anchors, each position scored
    # where the target's top-8 meets the 50-token draft vocabulary
    assert counts["n"].shape == (4,) and 0 < counts["n"][0] <= 18
    loss.backward()
    assert heads.mask_embedding.grad.abs().sum() > 0 and heads.fc.weight.grad.abs().sum() > 0
    ce, ce_counts = block_loss(heads, batch, block_weights(4, 4.0), anchors_per_seq=64, distill=0.0)
    assert torch.isfinite(ce) and ce_counts["n"][0] == 18  # the data's tokens: every anchor scores


@pytest.fixture()
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("block")
    folder = tiny_target(root / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.no_grad():  # peaked next-token distributions: something to learn
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return {"model": str(folder), "data": str(write_counting_data(root / "count.jsonl", 48))}


def config(setup, out: Path, **kw) -> TrainConfig:
    base = dict(model=setup["model"], data=[setup["data"]], kind="block", num_heads=4, max_length=48, eval_fraction=0.1,
                batch_size=4, lr=3e-3, warmup_steps=2, max_steps=40, eval_every=0, eval_batches=0, log_every=1,
                save_every=0, output=str(out), wandb=False, train_vocab=16, seed=3, block_anchors=8)
    base.update(kw)
    return TrainConfig(**base)


def history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss_and_writes_a_loadable_folder(setup, tmp_path, fresh_accelerate_state):
    out = tmp_path / "heads"
    train(config(setup, out, cache_dir=str(tmp_path / "features")))
    rows = history(out)
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert sum(losses[-5:]) < 0.75 * sum(losses[:5]), losses
    assert evals[-1]["head1/loss"] < evals[0]["head1/loss"] and evals[-1]["head4/loss"] < evals[0]["head4/loss"], evals
    saved = read_heads_config(out)
    assert (saved.kind, saved.num_heads, saved.draft_vocab_size, saved.feature_layers) == ("block", 4, 16, [0, 1])
    meta = json.loads((tmp_path / "features" / "train" / "meta.json").read_text())
    assert meta["layers"] == saved.feature_layers  # the cache holds the layers the heads fuse
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")) == ["model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(setup["model"])
    heads = load_heads(out, model)
    assert isinstance(heads, BlockHeads) and heads.block_size == 4 and heads.draft_vocab.numel() == 16
    weights = load_file(out / "model.safetensors")
    assert "mask_embedding" in weights and not any(k.startswith("_target") for k in weights)
    for k, v in heads.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_without_a_cache_the_target_runs_each_step_over_the_fused_layers(setup, tmp_path, fresh_accelerate_state):
    out = tmp_path / "heads"
    train(config(setup, out, max_steps=3, feature_layers=[1, 0]))
    losses = [r["loss"] for r in history(out) if r["kind"] == "train"]
    assert len(losses) == 3 and all(0 < x < 100 for x in losses), losses
    assert read_heads_config(out).feature_layers == [1, 0] and not (tmp_path / "features").exists()


def test_resume_reaches_the_uninterrupted_result(setup, tmp_path, fresh_accelerate_state):
    kw = dict(max_steps=6, save_every=3, keep_checkpoints=1, cache_dir=str(tmp_path / "features"))
    full = tmp_path / "full"
    train(config(setup, full, **kw))
    resumed = tmp_path / "resumed"
    ckpt = latest_checkpoint(full)
    assert ckpt is not None and ckpt.name == "step-0000003"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    (resumed / "checkpoints" / "latest").write_text(ckpt.name)
    AcceleratorState._reset_state(True)
    train(config(setup, resumed, resume=True, **kw))
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    assert [r for r in history(resumed) if r["kind"] == "train"][0]["step"] == 4


def test_an_eagle3_feature_cache_serves_block_training_unchanged(setup, tmp_path, fresh_accelerate_state):
    cache = tmp_path / "features"
    train(config(setup, tmp_path / "eagle3", kind="eagle3", num_heads=3, max_steps=1, cache_dir=str(cache)))
    before = {p.name: p.stat().st_mtime_ns for p in sorted((cache / "train").iterdir())}
    AcceleratorState._reset_state(True)
    train(config(setup, tmp_path / "block", max_steps=2, cache_dir=str(cache)))
    assert {p.name: p.stat().st_mtime_ns for p in sorted((cache / "train").iterdir())} == before
    assert not (cache / "train.previous").exists()
    assert read_heads_config(tmp_path / "block").kind == "block"
    AcceleratorState._reset_state(True)
    train(config(setup, tmp_path / "block-layers", max_steps=1, cache_dir=str(cache), feature_layers=[1, 0]))
    assert json.loads((cache / "train" / "meta.json").read_text())["layers"] == [1, 0]  # other layers: rebuilt


def test_bad_block_settings_are_one_line_errors(setup, tmp_path, fresh_accelerate_state):
    cases = [(dict(block_anchors=0), "block_anchors"), (dict(block_decay=0.0), "block_decay"),
             (dict(num_layers=3), "num_layers"), (dict(lora=True), "drop lora")]
    for kw, match in cases:
        with pytest.raises(MedusaError, match=match) as err:
            config(setup, tmp_path / "x", **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(MedusaError, match="block_anchors=-1 must be at least 1"):
        from_dict(TrainConfig, {"kind": "block", "block_anchors": -1})
    with pytest.raises(MedusaError, match="feature_layers"):
        HeadsConfig(hidden_size=64, vocab_size=96, kind="block", feature_layers=[0], draft_vocab_size=16)
    with pytest.raises(MedusaError, match="1 or 2 decoder layers"):
        HeadsConfig(hidden_size=64, vocab_size=96, kind="block", num_layers=3, feature_layers=[0, 1], draft_vocab_size=16)
    model = tiny_model("llama")
    eagle3 = init_eagle3_for(model, 3, vocab=torch.arange(16), feature_layers=[0, 1])
    with pytest.raises(MedusaError, match="kind 'block'"):
        BlockHeads(eagle3.config, model)
    save_heads(eagle3, tmp_path / "eagle3")
    target = AutoModelForCausalLM.from_pretrained(setup["model"])
    save_heads(init_eagle3_for(target, 3, vocab=torch.arange(16)), tmp_path / "eagle3-tiny")
    with pytest.raises(MedusaError, match="holds eagle3 heads but kind is block"):
        train(config(setup, tmp_path / "x", init_heads=str(tmp_path / "eagle3-tiny")))
