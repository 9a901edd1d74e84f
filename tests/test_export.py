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
from medusa.hub.export import export_heads, load_plain_tensors, read_fasterdecoding
from medusa.hub.hub import load_heads_from, read_heads
from medusa.models.heads import HeadsConfig, heads_from_state
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
    spec = importlib.util.spec_from_file_location("export_heads", REPO / "scripts" / "export_heads.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "vllm"
    rc = script.main([str(heads_folder), "--to", "vllm", "--out", str(out), "--model", str(folder_target),
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
    spec = importlib.util.spec_from_file_location("export_heads", REPO / "scripts" / "export_heads.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "vllm"
    assert script.main([str(folder), "--to", "vllm", "--out", str(out), "--draft-vocab"]) == 0

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
    assert script.main([str(heads.save(tmp_path / "uncalibrated")), "--to", "vllm", "--out", str(tmp_path / "x"),
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


def test_eagle_heads_have_no_foreign_export(tmp_path):
    config = HeadsConfig(hidden_size=8, vocab_size=16, num_heads=2, kind="eagle")
    for layout in ("vllm", "fasterdecoding"):
        with pytest.raises(MedusaError, match=f"eagle heads have no {layout} export") as err:
            export_heads(config, {}, tmp_path / layout, layout)
        assert "\n" not in str(err.value)
        assert not (tmp_path / layout).exists()
