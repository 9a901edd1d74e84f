"""Training EAGLE heads with the one training loop: loss falls, acceptance rises, TTT unrolls."""

import json

import pytest
import torch
from accelerate.state import AcceleratorState
from tiny import DRAFTING, tiny_model
from train_fixtures import tiny_target, write_counting_data
from transformers import AutoModelForCausalLM

import medusa
from medusa.models.eagle_heads import EagleHeads, init_eagle_for
from medusa.models.heads_config import read_heads_config
from medusa.training.eagle_ttt import eagle_loss, ttt_visible
from medusa.training.loop import TrainConfig, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # The fixture's target with larger weights: peaked next-token distributions (a
    # default-initialised model is near uniform, and its argmax is noise nothing can learn).
    root = tmp_path_factory.mktemp("eagle")
    folder = tiny_target(root / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return {"model": str(folder), "data": str(write_counting_data(root / "count.jsonl", 48))}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield


def history(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_eagle_training_loss_falls_accuracy_rises_and_the_heads_decode(setup, tmp_path):
    out = tmp_path / "eagle"
    cfg = TrainConfig(model=setup["model"], data=[setup["data"]], kind="eagle", num_heads=3, cache_dir=str(tmp_path / "c"),
                      max_length=48, eval_fraction=0.1, batch_size=4, lr=3e-3, warmup_steps=2, max_steps=40,
                      eval_every=40, eval_batches=0, log_every=1, save_every=0, output=str(out), wandb=False,
                      distill=1.0, seed=3)
    train(cfg)
    rows = history(out)
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    # every unrolled step (depth 1..3) learned to predict the target's next token
    for k in (1, 2, 3):
        assert evals[-1][f"head{k}/top1"] > evals[0][f"head{k}/top1"] + 0.2, (k, evals)
    assert read_heads_config(out).kind == "eagle"
    engine = medusa.load(model=setup["model"], heads=str(out), device="cpu", proposers=DRAFTING)
    assert isinstance(engine.heads, EagleHeads)
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "count from three please"}], add_generation_prompt=True)
    base = engine.generate(ids, max_new_tokens=20, mode="baseline")
    res = engine.generate(ids, max_new_tokens=20, mode="eagle")
    assert res.tokens == base.tokens
    assert res.stats.tau > 1.5  # the trained head's drafts are accepted


def test_ttt_mask_sees_the_true_context_and_its_own_chain():
    v = ttt_visible(4, 2, torch.device("cpu"))  # 4 positions, unroll step 2: keys of steps 0, 1, 2
    # row 3: true pairs 0..1, step 1's pair at 2, step 2's pair at 3 (itself)
    assert v[3].nonzero().view(-1).tolist() == [0, 1, 4 + 2, 8 + 3]
    # row 0 has no true context at step 2: only the chain entries that exist (itself)
    assert v[0].nonzero().view(-1).tolist() == [8 + 0]
    assert ttt_visible(3, 0, torch.device("cpu")).tolist() == torch.ones(3, 3).tril().bool().tolist()


def test_ttt_unrolls_the_configured_number_of_steps():
    model = tiny_model("llama")
    heads = init_eagle_for(model, num_steps=3).float()
    calls = []
    heads.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    t = 10
    seq = {"hidden": torch.randn(t, 64), "tokens": torch.randint(4, 90, (t,)), "loss_mask": torch.ones(t, dtype=torch.bool),
           "teacher_ids": torch.randint(0, 96, (t, 4)), "teacher_logp": torch.log_softmax(torch.randn(t, 4), -1)}
    loss, counts = eagle_loss(heads, [seq], [1.0, 0.8, 0.64])
    assert calls == [t - 2] * 3  # one pass per unrolled step over every pair
    assert counts["n"].tolist() == [8, 7, 6]  # step j scores rows whose chain starts inside the sequence
    loss.backward()
    assert heads.fc.weight.grad is not None and torch.isfinite(loss)


def test_eagle_init_choice_is_honoured():
    model = tiny_model("llama")
    last = model.get_decoder().layers[-1].state_dict()
    warm = init_eagle_for(model, num_steps=2).float()  # the default: last_layer
    assert all(torch.equal(warm.layer.state_dict()[k], v) for k, v in last.items())
    h = warm.config.hidden_size
    assert torch.equal(warm.fc.weight[:, :h], torch.eye(h))  # "take the feature"
    torch.manual_seed(0)
    cold = init_eagle_for(model, num_steps=2, init="random").float()
    assert not torch.equal(cold.layer.self_attn.q_proj.weight, last["self_attn.q_proj.weight"])
    assert not torch.equal(cold.fc.weight[:, :h], torch.eye(h))
    assert 0.005 < cold.fc.weight.std().item() < 0.05  # small random
    tok = init_eagle_for(model, num_steps=2, init="last_layer_token").float()
    assert all(torch.equal(tok.layer.state_dict()[k], v) for k, v in last.items())
    assert torch.equal(tok.fc.weight[:, :h], torch.eye(h))
    scale = tok.fc.weight[0, h].item()  # the token's embedding, scaled to the feature's size
    assert scale > 0 and torch.allclose(tok.fc.weight[:, h:], torch.eye(h) * scale)
    with pytest.raises(medusa.MedusaError, match="eagle init"):
        init_eagle_for(model, init="bogus")


def test_eagle_init_is_a_config_field_the_trainer_uses():
    from medusa.config import TrainConfig, from_dict
    from medusa.training.heads_task import HeadsTask

    model = tiny_model("llama")
    last = model.get_decoder().layers[-1].state_dict()["self_attn.q_proj.weight"]
    for init, copies_last in (("last_layer_token", True), ("random", False)):
        cfg = from_dict(TrainConfig, {"kind": "eagle", "num_heads": 2, "eagle_init": init, "cache_dir": "unused"})
        heads = HeadsTask(cfg).heads(model, accelerator=None)
        assert torch.equal(heads.layer.self_attn.q_proj.weight, last) == copies_last, init
    with pytest.raises(medusa.MedusaError, match="eagle_init"):
        from_dict(TrainConfig, {"eagle_init": "warm"})


def test_eagle_layout_is_a_config_field_and_eagle1_starts_as_the_fused_input():
    from medusa.config import TrainConfig, from_dict
    from medusa.models.eagle_heads import additive_mask
    from medusa.runtime.hf import new_cache
    from medusa.training.heads_task import HeadsTask

    model = tiny_model("llama")
    with torch.no_grad():  # non-trivial norm weights, so the folding shows
        model.get_decoder().layers[-1].input_layernorm.weight.uniform_(0.5, 1.5)
        model.get_decoder().norm.weight.uniform_(1.0, 3.0)
    cfg = from_dict(TrainConfig, {"kind": "eagle", "num_heads": 2, "eagle_layout": "eagle1", "cache_dir": "unused"})
    heads = HeadsTask(cfg).heads(model, accelerator=None)
    assert heads.config.eagle_layout == "eagle1"
    assert HeadsTask(from_dict(TrainConfig, {"kind": "eagle", "cache_dir": "unused"})).heads(
        model, accelerator=None).config.eagle_layout == "norms"  # the default
    with pytest.raises(medusa.MedusaError, match="eagle_layout"):
        from_dict(TrainConfig, {"eagle_layout": "vllm"})

    # The warm start: the last layer with its input norm folded into q/k/v at a normed
    # feature's RMS, and zero output projections, so the output is the fused input (the
    # feature plus a small token share) and scores near the target's own next token.
    last = model.get_decoder().layers[-1]
    g_in, g_f = last.input_layernorm.weight, model.get_decoder().norm.weight
    scale = g_in / g_f.pow(2).mean().sqrt()
    torch.testing.assert_close(heads.layer.self_attn.q_proj.weight, last.self_attn.q_proj.weight * scale[None])
    torch.testing.assert_close(heads.layer.self_attn.v_proj.weight, last.self_attn.v_proj.weight * scale[None])
    assert torch.equal(heads.layer.mlp.up_proj.weight, last.mlp.up_proj.weight)
    assert not heads.layer.self_attn.o_proj.weight.any() and not heads.layer.mlp.down_proj.weight.any()
    n, h = 6, heads.config.hidden_size
    feats, toks = torch.randn(n, h), torch.randint(4, 90, (n,))
    with torch.no_grad():
        out = heads(feats, toks, torch.arange(n), new_cache(buffered=False),
                    additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.float32))
        fused = heads.fc(torch.cat([feats, model.get_input_embeddings()(toks)], -1))
    torch.testing.assert_close(out, fused)
