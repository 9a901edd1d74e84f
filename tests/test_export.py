"""Foreign checkpoint layouts: FasterDecoding Medusa-1 import (safetensors and .pt, with
pickles that are not plain tensors refused), vLLM and FasterDecoding export."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny_heads import PROMPT, REPO, random_heads, target_folder
from torch import nn

import medusa
from medusa.errors import MedusaError
from medusa.hub.export import export_heads
from medusa.hub.fasterdecoding import load_plain_tensors, read_fasterdecoding
from medusa.hub.hub import load_heads_from, read_heads
from medusa.models.heads_config import save_heads
from medusa.models.loader import heads_from_state
from medusa.models.target import load_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = target_folder(tmp_path_factory.mktemp("export"))
    model, _ = load_target(str(folder), device="cpu", dtype=torch.float32)
    return folder, model


class FDResBlock(nn.Module):
    """FasterDecoding's residual block: ``x + SiLU(linear(x))``, its parameter under ``linear``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def fasterdecoding_heads(hidden: int, vocab: int, num_heads: int, num_layers: int, seed: int = 3) -> nn.ModuleList:
    """FasterDecoding's ``medusa_head`` module: per head, the blocks then a bias-free projection
    (separate blocks per layer, so a layer mix-up in the key conversion would show)."""
    torch.manual_seed(seed)
    heads = nn.ModuleList(
        nn.Sequential(*[FDResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    return heads


def write_fasterdecoding(folder: Path, module: nn.ModuleList, num_layers: int, fmt: str, state=None) -> Path:
    folder.mkdir(parents=True)
    config = {"medusa_num_heads": len(module), "medusa_num_layers": num_layers,
              "base_model_name_or_path": "tester/tiny-llama", "transformers_version": "4.35.0"}
    (folder / "config.json").write_text(json.dumps(config))
    state = state if state is not None else {k: v.contiguous() for k, v in module.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, folder / "medusa_lm_head.safetensors")
    else:
        torch.save(state, folder / "medusa_lm_head.pt")
    return folder


@pytest.mark.parametrize("fmt, num_layers", [("safetensors", 1), ("pt", 1), ("safetensors", 2)])
def test_fasterdecoding_checkpoint_imports_with_the_same_logits(target, tmp_path, fmt, num_layers):
    folder_target, model = target
    hidden_size, vocab = model.config.hidden_size, model.config.vocab_size
    fd = fasterdecoding_heads(hidden_size, vocab, num_heads=3, num_layers=num_layers)
    ckpt = write_fasterdecoding(tmp_path / "fd", fd, num_layers, fmt)

    heads = load_heads_from(str(ckpt), model)
    assert heads.config.projection == "per_head"
    assert (heads.config.num_heads, heads.config.num_layers) == (3, num_layers)
    assert heads.config.base_model == "tester/tiny-llama"
    hidden = torch.randn(4, hidden_size)
    with torch.no_grad():
        expected = torch.stack([head(hidden) for head in fd])  # [K, 4, V]
    torch.testing.assert_close(heads(hidden), expected, rtol=0, atol=1e-6)

    # And through the public entry point: the engine decodes with the imported heads.
    engine = medusa.load(model=str(folder_target), heads=str(ckpt), device="cpu", dtype="float32")
    assert engine.heads.config.projection == "per_head"
    assert engine.generate(PROMPT, max_new_tokens=8).tokens == engine.generate(PROMPT, max_new_tokens=8, mode="baseline").tokens


class Payload:
    """Unpickling this calls ``Path.write_text(marker, ...)``: code run by merely loading a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_pickle_that_runs_code_is_refused(target, tmp_path):
    _, model = target
    fd = fasterdecoding_heads(model.config.hidden_size, model.config.vocab_size, num_heads=2, num_layers=1)
    state = dict(fd.state_dict())

    # The payload is real: an unrestricted unpickle runs it.
    proof = tmp_path / "proof"
    torch.save({**state, "payload": Payload(proof)}, tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert proof.read_text() == "code ran"

    marker = tmp_path / "marker"
    ckpt = write_fasterdecoding(tmp_path / "fd", fd, 1, "pt", state={**state, "payload": Payload(marker)})
    with pytest.raises(MedusaError) as err:
        load_heads_from(str(ckpt), model)
    message = str(err.value)
    assert "refused" in message and "weights_only=True" in message and "\n" not in message
    assert not marker.exists()


def test_pickle_with_non_tensor_values_is_refused(tmp_path):
    path = tmp_path / "medusa_lm_head.pt"
    torch.save({"0.0.linear.weight": torch.zeros(2, 2), "step": 7}, path)
    with pytest.raises(MedusaError, match="expected a dict of tensors"):
        load_plain_tensors(path)


def test_fasterdecoding_checkpoint_with_foreign_keys_is_refused(target, tmp_path):
    _, model = target
    fd = fasterdecoding_heads(model.config.hidden_size, model.config.vocab_size, num_heads=2, num_layers=1)
    state = {**fd.state_dict(), "model.embed_tokens.weight": torch.zeros(4, 4)}
    ckpt = write_fasterdecoding(tmp_path / "fd", fd, 1, "safetensors", state=state)
    with pytest.raises(MedusaError, match="not Medusa-1 heads"):
        read_fasterdecoding(ckpt)


def vllm_forward(tensors: dict[str, torch.Tensor], config: dict, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa drafter computation, written from its layout: per head, residual layers
    ``x + SiLU(W x + b)`` then that head's ``lm_heads`` projection; with a ``token_map`` the
    projection covers those tokens only and every other token gets -inf. ``[T, H] -> [K, T, V]``."""
    out = []
    for k in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, tensors[f"blocks.{k}.layers.{j}.weight"], tensors[f"blocks.{k}.layers.{j}.bias"]))
        # original_lm_head: one projection, stored once, for every head
        proj = tensors["lm_head.weight"] if config.get("original_lm_head") else tensors[f"lm_heads.{k}.weight"]
        logits = x @ proj.T  # [T, truncated_vocab_size]
        if "token_map" in tensors:
            full = torch.full((x.shape[0], config["vocab_size"]), float("-inf"))
            full[:, tensors["token_map"]] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("projection, num_layers", [("shared", 1), ("per_head", 2)])
def test_vllm_export_names_shapes_config_and_function(target, tmp_path, projection, num_layers):
    _, model = target
    heads = random_heads(model, projection=projection, num_layers=num_layers, num_heads=3)
    config, state = read_heads(heads.save(tmp_path / "heads"))
    lm_head = model.get_output_embeddings().weight
    out = export_heads(config, state, tmp_path / "vllm", "vllm", lm_head=lm_head if projection == "shared" else None)

    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    h, v = model.config.hidden_size, model.config.vocab_size
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, num_layers, h, v)
    assert cfg["truncated_vocab_size"] == v and cfg["medusa_fc_bias"] is True
    # vLLM renames any key containing "num" to num_heads/num_hidden_layers: only those two may hold it.
    assert sorted(k for k in cfg if "num" in k) == ["num_heads", "num_hidden_layers"]

    tensors = load_file(out / "model.safetensors")
    expected = {f"blocks.{k}.layers.{j}.{p}" for k in range(3) for j in range(num_layers) for p in ("weight", "bias")}
    # Shared heads: the target's lm_head once (vLLM's original_lm_head), not once per head.
    expected |= {"lm_head.weight"} if projection == "shared" else {f"lm_heads.{k}.weight" for k in range(3)}
    assert set(tensors) == expected
    assert cfg["original_lm_head"] is (projection == "shared")
    for k in range(3):
        assert tensors["lm_head.weight" if projection == "shared" else f"lm_heads.{k}.weight"].shape == (v, h)
        for j in range(num_layers):
            assert tensors[f"blocks.{k}.layers.{j}.weight"].shape == (h, h)
            assert tensors[f"blocks.{k}.layers.{j}.bias"].shape == (h,)
            assert torch.equal(tensors[f"blocks.{k}.layers.{j}.weight"], state[f"blocks.{k}.{j}.linear.weight"])
    if projection == "shared":
        assert torch.equal(tensors["lm_head.weight"], lm_head)

    hidden = torch.randn(4, h)
    torch.testing.assert_close(vllm_forward(tensors, cfg, hidden), heads(hidden), rtol=0, atol=1e-5)


@pytest.mark.parametrize("projection", ["shared", "per_head"])
def test_fasterdecoding_export_round_trips(target, tmp_path, projection):
    _, model = target
    heads = random_heads(model, projection=projection, num_layers=1, num_heads=3)
    config, state = read_heads(heads.save(tmp_path / "heads"))
    out = export_heads(config, state, tmp_path / "fd", "fasterdecoding", lm_head=model.get_output_embeddings().weight)

    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 1)
    raw = load_file(out / "medusa_lm_head.safetensors")
    assert set(raw) == {f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")} | {f"{k}.1.weight" for k in range(3)}
    back_config, back_state = read_fasterdecoding(out)
    back = heads_from_state(back_config, back_state, model)
    hidden = torch.randn(4, model.config.hidden_size)
    torch.testing.assert_close(back(hidden), heads(hidden), rtol=0, atol=1e-6)


def test_shared_heads_need_the_target_to_export(target, tmp_path):
    _, model = target
    config, state = read_heads(random_heads(model).save(tmp_path / "heads"))
    with pytest.raises(MedusaError, match="--model"):
        export_heads(config, state, tmp_path / "vllm", "vllm")
    assert not (tmp_path / "vllm").exists()


def test_export_never_overwrites_a_foreign_folder(target, tmp_path):
    _, model = target
    config, state = read_heads(random_heads(model, projection="per_head").save(tmp_path / "heads"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(MedusaError, match="notes.txt"):
        export_heads(config, state, busy, "vllm")
    assert (busy / "notes.txt").read_text() == "keep me"
    export_heads(config, state, tmp_path / "again", "vllm")
    export_heads(config, state, tmp_path / "again", "vllm")  # an earlier export is replaced


def test_export_script_copies_the_target_lm_head(target, tmp_path, capsys):
    folder_target, model = target
    heads_folder = random_heads(model).save(tmp_path / "heads")
    script = export_script()
    out = tmp_path / "vllm"
    rc = script.main([str(heads_folder), "--to", "vllm", "--output", str(out), "--model", str(folder_target),
                      "--dtype", "float16"])
    assert rc == 0
    tensors = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert torch.equal(tensors["lm_head.weight"], model.get_output_embeddings().weight.half())
    printed = capsys.readouterr().out
    assert "vllm serve" in printed and '"method": "medusa"' in printed and '"num_speculative_tokens": 3' in printed


def test_vllm_export_with_a_draft_vocabulary(target, tmp_path, capsys):
    folder_target, model = target
    heads = random_heads(model, projection="per_head", num_heads=2)
    folder = heads.save(tmp_path / "heads")
    vocab = [40, 5, 9, 2, 63]
    (folder / "calibration.json").write_text(json.dumps({"trees": {"cpu": [[0], [1]]}, "draft_vocab": vocab}))
    script = export_script()
    out = tmp_path / "vllm"
    assert script.main([str(folder), "--to", "vllm", "--output", str(out), "--draft-vocab"]) == 0

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["truncated_vocab_size"] == len(vocab) and cfg["vocab_size"] == model.config.vocab_size
    tensors = load_file(out / "model.safetensors")
    assert tensors["token_map"].tolist() == sorted(vocab) and tensors["token_map"].dtype == torch.int64
    assert tensors["lm_heads.1.weight"].shape == (len(vocab), model.config.hidden_size)
    hidden = torch.randn(3, model.config.hidden_size)
    drafted = vllm_forward(tensors, cfg, hidden)  # [K, T, V], -inf outside the draft vocabulary
    full = heads(hidden)
    torch.testing.assert_close(drafted[..., sorted(vocab)], full[..., sorted(vocab)], rtol=0, atol=1e-6)
    assert torch.isinf(drafted).sum() == 2 * 3 * (model.config.vocab_size - len(vocab))

    with pytest.raises(MedusaError, match="only be exported to the vllm layout"):
        config, state = read_heads(folder)
        export_heads(config, state, tmp_path / "fd", "fasterdecoding", draft_vocab=vocab)
    assert script.main([str(heads.save(tmp_path / "uncalibrated")), "--to", "vllm", "--output", str(tmp_path / "x"),
                        "--draft-vocab"]) == 1
    assert "no calibrated draft vocabulary" in capsys.readouterr().err


def test_shared_heads_with_a_draft_vocabulary_store_one_truncated_projection(target, tmp_path):
    _, model = target
    heads = random_heads(model, num_heads=3)  # shared projection
    config, state = read_heads(heads.save(tmp_path / "heads"))
    vocab = [7, 3, 50, 11]
    lm_head = model.get_output_embeddings().weight
    out = export_heads(config, state, tmp_path / "vllm", "vllm", lm_head=lm_head, draft_vocab=vocab)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert cfg["original_lm_head"] is True and cfg["truncated_vocab_size"] == 4
    assert not any(k.startswith("lm_heads.") for k in tensors)
    assert torch.equal(tensors["lm_head.weight"], lm_head[sorted(vocab)])  # [S, H]: the only projection
    hidden = torch.randn(3, model.config.hidden_size)
    drafted = vllm_forward(tensors, cfg, hidden)
    torch.testing.assert_close(drafted[..., sorted(vocab)], heads(hidden)[..., sorted(vocab)], rtol=0, atol=1e-6)


def export_script():
    """scripts/export_heads.py as a module."""
    spec = importlib.util.spec_from_file_location("export_heads", REPO / "scripts" / "export_heads.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def noisy_eagle1(model, seed: int = 5, scale: float = 0.05):
    """eagle1 heads warm-started, then moved by noise: every weight distinct and non-zero (the
    warm start zeroes the output projections), so a wrong name or a swapped fc half shows."""
    from medusa.models.eagle_heads import init_eagle_for

    heads = init_eagle_for(model, num_steps=2, layout="eagle1").float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (Llama's): ``[T, heads, d]`` at ``positions`` ``[T]``."""
    d = x.shape[-1]
    freqs = positions[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)  # [T, d/2]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def vllm_eagle_forward(tensors: dict[str, torch.Tensor], config: dict, embed: torch.Tensor, features: torch.Tensor,
                       tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """vLLM's EAGLE-1 Llama drafter (llama_eagle.py), written from its layout for one causal
    pass: ``x = fc(cat(embed(token), feature))`` (token first), one Llama layer with no input
    norm (the residual is x itself), and no final norm: the output is hidden + residual.
    ``[T, H] features, [T] tokens -> [T, H]`` (what lm_head scores and the next step reads)."""
    from transformers import LlamaConfig

    c = LlamaConfig.from_dict(config)  # as vLLM reads the folder: the class fills what the file leaves out
    t = tensors
    w = lambda name: t[f"layers.0.{name}.weight"]  # noqa: E731
    n_heads, n_kv = c.num_attention_heads, c.num_key_value_heads
    d = c.head_dim
    theta = c.rope_parameters["rope_theta"]
    x = torch.cat([embed[tokens], features], dim=-1) @ t["fc.weight"].T  # [T, H]
    n = x.shape[0]
    q = rotate((x @ w("self_attn.q_proj").T).view(n, n_heads, d), positions, theta)
    k = rotate((x @ w("self_attn.k_proj").T).view(n, n_kv, d), positions, theta)
    v = (x @ w("self_attn.v_proj").T).view(n, n_kv, d)
    k, v = k.repeat_interleave(n_heads // n_kv, dim=1), v.repeat_interleave(n_heads // n_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, n_heads * d) @ w("self_attn.o_proj").T
    residual = x + attn
    h = rms_norm(residual, w("post_attention_layernorm"), c.rms_norm_eps)
    mlp = (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    return mlp + residual


def test_eagle1_export_is_vllm_s_eagle1_drafter_computing_the_head_s_function(target, tmp_path, capsys):
    from medusa.models.eagle_heads import additive_mask
    from medusa.runtime.hf import new_cache

    folder_target, model = target
    heads = noisy_eagle1(model)
    folder = save_heads(heads, tmp_path / "heads")
    script = export_script()
    out = tmp_path / "vllm"
    assert script.main([str(folder), "--to", "vllm", "--output", str(out), "--model", str(folder_target)]) == 0
    printed = capsys.readouterr().out
    assert '"method": "eagle"' in printed and '"num_speculative_tokens": 2' in printed

    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    h, v = model.config.hidden_size, model.config.vocab_size
    # vLLM's EAGLEConfig renames LlamaForCausalLM to EagleLlamaForCausalLM; one layer.
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (1, h, v)
    assert cfg["num_attention_heads"] == model.config.num_attention_heads and cfg["dtype"] == "float32"
    tensors = load_file(out / "model.safetensors")
    layer = {f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                              "post_attention_layernorm")}
    # No input norm (the layout has none), no embed_tokens or lm_head: vLLM shares the target's.
    assert set(tensors) == {"fc.weight"} | layer
    assert tensors["fc.weight"].shape == (h, 2 * h)
    fc = heads.fc.weight.detach()
    assert torch.equal(tensors["fc.weight"][:, :h], fc[:, h:]) and torch.equal(tensors["fc.weight"][:, h:], fc[:, :h])
    assert torch.equal(tensors["layers.0.mlp.down_proj.weight"], heads.layer.mlp.down_proj.weight)

    # The function: vLLM's drafter written from the exported tensors == the head, on a causal pass
    # and on the next draft step, which reads the first pass's output as its feature.
    n = 7
    g = torch.Generator().manual_seed(0)
    features = torch.randn(n, h, generator=g) * 2
    tokens = torch.randint(0, v, (n,), generator=g)
    positions = torch.arange(3, 3 + n)
    embed = model.get_input_embeddings().weight.detach()
    with torch.no_grad():
        ours = heads(features, tokens, positions, new_cache(buffered=False),
                     additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.float32))
        theirs = vllm_eagle_forward(tensors, cfg, embed, features, tokens, positions)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        # logits: the target's lm_head on the output as it is (no final norm)
        torch.testing.assert_close(heads.logits(ours), theirs @ model.get_output_embeddings().weight.T,
                                   rtol=1e-5, atol=1e-5)
        step2 = torch.cat([features[1:], ours[-1:]])  # shift: the last pair now carries the drafted feature
        ours2 = heads(step2, tokens.roll(-1), positions + 1, new_cache(buffered=False),
                      additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.float32))
        theirs2 = vllm_eagle_forward(tensors, cfg, embed, step2, tokens.roll(-1), positions + 1)
        torch.testing.assert_close(ours2, theirs2, rtol=1e-5, atol=1e-5)


def test_eagle_heads_in_the_norms_layout_are_refused_in_one_line(target, tmp_path, capsys):
    from medusa.models.eagle_heads import init_eagle_for

    folder_target, model = target
    folder = save_heads(init_eagle_for(model, num_steps=2), tmp_path / "norms")  # the default layout
    config, state = read_heads(folder)
    assert config.eagle_layout == "norms"
    with pytest.raises(MedusaError, match="eagle_layout: eagle1") as err:
        export_heads(config, state, tmp_path / "vllm", "vllm", target_config=model.config.to_dict())
    assert "\n" not in str(err.value) and "norms layout" in str(err.value)
    assert not (tmp_path / "vllm").exists()
    script = export_script()
    assert script.main([str(folder), "--to", "vllm", "--output", str(tmp_path / "x"), "--model", str(folder_target)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "eagle_layout: eagle1" in lines[0]
    # FasterDecoding's layout has no eagle heads of any layout
    eagle1 = noisy_eagle1(model)
    config, state = read_heads(save_heads(eagle1, tmp_path / "eagle1"))
    with pytest.raises(MedusaError, match="eagle heads have no fasterdecoding export") as err:
        export_heads(config, state, tmp_path / "fd", "fasterdecoding")
    assert "\n" not in str(err.value)
    # nor a draft vocabulary: vLLM's EAGLE-1 drafter scores the full vocabulary
    with pytest.raises(MedusaError, match="full vocabulary"):
        export_heads(config, state, tmp_path / "v", "vllm", draft_vocab=[1, 2], target_config=model.config.to_dict())


def test_eagle1_export_needs_a_llama_target_of_the_heads_size(target, tmp_path):
    _, model = target
    config, state = read_heads(save_heads(noisy_eagle1(model), tmp_path / "heads"))
    with pytest.raises(MedusaError, match="Llama's"):
        export_heads(config, state, tmp_path / "a", "vllm", target_config={**model.config.to_dict(), "model_type": "qwen2"})
    with pytest.raises(MedusaError, match="hidden size"):
        export_heads(config, state, tmp_path / "b", "vllm", target_config={**model.config.to_dict(), "hidden_size": 32})


def test_eagle3_export_is_vllm_s_eagle3_drafter(target, tmp_path, capsys):
    from medusa.models.eagle3_heads import init_eagle3_for

    folder_target, model = target
    torch.manual_seed(2)
    # vLLM's EAGLE-3 drafter fuses three target layers: the two-layer target's inputs, one twice
    heads = init_eagle3_for(model, 7, vocab=torch.arange(3, model.config.vocab_size, 2), feature_layers=[0, 1, 1])
    folder = save_heads(heads, tmp_path / "heads")
    script = export_script()
    out = tmp_path / "vllm"
    assert script.main([str(folder), "--to", "vllm", "--output", str(out), "--model", str(folder_target)]) == 0
    printed = capsys.readouterr().out
    assert '"method": "eagle3"' in printed and '"num_speculative_tokens": 7' in printed
    cfg = json.loads((out / "config.json").read_text())
    h, v, s = model.config.hidden_size, model.config.vocab_size, heads.config.draft_vocab_size
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (1, h, v, s)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(heads.feature_layers)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(heads.feature_layers)
    assert cfg["head_dim"] * cfg["num_attention_heads"] == heads.layers[0].self_attn.q_proj.out_features
    tensors = load_file(out / "model.safetensors")
    # vLLM's names are the heads' own; no embed_tokens (vLLM shares the target's)
    assert set(tensors) == set(heads.state_dict())
    assert tensors["fc.weight"].shape == (h, len(heads.feature_layers) * h)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * h  # attention reads [embed ; feature]
    assert tensors["lm_head.weight"].shape == (s, h)
    # draft id i is target token i + d2t[i]
    assert torch.equal(torch.arange(s) + tensors["d2t"], torch.arange(3, v, 2)[:s])
    for name, tensor in heads.state_dict().items():
        assert torch.equal(tensors[name], tensor), name
    # over the full vocabulary there is no map to write
    full = init_eagle3_for(model, 7, feature_layers=[0, 1, 1])
    config, state = read_heads(save_heads(full, tmp_path / "full"))
    export_heads(config, state, tmp_path / "full-vllm", "vllm", target_config=model.config.to_dict())
    assert "d2t" not in load_file(tmp_path / "full-vllm" / "model.safetensors")
    with pytest.raises(MedusaError, match="no fasterdecoding export"):
        export_heads(config, state, tmp_path / "fd", "fasterdecoding", target_config=model.config.to_dict())
    with pytest.raises(MedusaError, match="own draft vocabulary"):
        export_heads(config, state, tmp_path / "dv", "vllm", draft_vocab=[1, 2], target_config=model.config.to_dict())
    with pytest.raises(MedusaError, match="hidden size"):
        export_heads(config, state, tmp_path / "hs", "vllm", target_config={**model.config.to_dict(), "hidden_size": 32})
    two = init_eagle3_for(model, 7)  # the two-layer target's default: two fused layers, which vLLM cannot read
    config, state = read_heads(save_heads(two, tmp_path / "two"))
    for layout in ("vllm", "speculators"):
        with pytest.raises(MedusaError, match="vLLM's EAGLE-3 drafter reads three"):
            export_heads(config, state, tmp_path / f"two-{layout}", layout, target_config=model.config.to_dict())


def test_block_heads_are_refused_in_one_line(target, tmp_path, capsys):
    """No serving engine reads the block layout: the API, the script and the vLLM export path say
    so in one line, and write nothing."""
    from medusa.models.block_heads import init_block_for
    from medusa.peers.vllm_client import export_for_vllm

    _, model = target
    folder = save_heads(init_block_for(model, block_size=4, vocab=torch.arange(64)), tmp_path / "block")
    config, state = read_heads(folder)
    assert config.kind == "block"
    for layout in ("vllm", "fasterdecoding"):
        with pytest.raises(MedusaError, match="block heads have no vLLM or FasterDecoding export") as err:
            export_heads(config, state, tmp_path / layout, layout, target_config=model.config.to_dict())
        assert "\n" not in str(err.value) and not (tmp_path / layout).exists()
    assert export_script().main([str(folder), "--to", "vllm", "--output", str(tmp_path / "x")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "mode block" in lines[0]
    with pytest.raises(MedusaError, match="block heads have no"):
        export_for_vllm(folder, None, tmp_path / "y")
