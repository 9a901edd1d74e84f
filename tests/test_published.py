"""Heads from elsewhere: checkpoints written here in each published layout (speculators eagle3 and
medusa, SafeAILab EAGLE-3 and EAGLE-1/2), with the tensor names and config keys those projects
define, load as this repo's heads, compute what their layout defines (a reference written from
the layout, not from this repo's modules) and decode exactly; exports to the speculators format
round-trip; pickled folders and what no kind here computes get one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import hf_greedy, tiny_model
from tiny_heads import PROMPT, REPO, random_heads, word_tokenizer

import medusa
from medusa.errors import MedusaError
from medusa.hub.hub import load_heads_from, read_heads
from medusa.models import published
from medusa.models.eagle_heads import additive_mask
from medusa.models.heads_config import save_heads
from medusa.models.loader import load_heads

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: per-call overhead, faster on one thread

LAYERS = 8  # deep enough for EAGLE-3's default layers 2, n // 2, n - 3 to be three distinct ones
H, HEADS, KV, HEAD_DIM, MLP, VOCAB = 64, 4, 2, 16, 128, 96


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny eight-layer Llama saved as a model folder (with a tokenizer) and loaded."""
    folder = tmp_path_factory.mktemp("published") / "target"
    model = tiny_model("llama", vocab_size=VOCAB, num_hidden_layers=LAYERS)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder, model


def randn(*shape, seed: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def norm_weight(seed: int) -> torch.Tensor:
    return 1 + randn(H, seed=seed)  # not ones: a norm mapped to the wrong place shows


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama_layer_tensors(prefix: str, q_in: int, seed: int, input_norm: bool = True) -> dict[str, torch.Tensor]:
    """One Llama decoder layer's tensors as HF names them, q/k/v reading ``q_in`` columns."""
    out = {
        f"{prefix}self_attn.q_proj.weight": randn(HEADS * HEAD_DIM, q_in, seed=seed),
        f"{prefix}self_attn.k_proj.weight": randn(KV * HEAD_DIM, q_in, seed=seed + 1),
        f"{prefix}self_attn.v_proj.weight": randn(KV * HEAD_DIM, q_in, seed=seed + 2),
        f"{prefix}self_attn.o_proj.weight": randn(H, HEADS * HEAD_DIM, seed=seed + 3),
        f"{prefix}mlp.gate_proj.weight": randn(MLP, H, seed=seed + 4),
        f"{prefix}mlp.up_proj.weight": randn(MLP, H, seed=seed + 5),
        f"{prefix}mlp.down_proj.weight": randn(H, MLP, seed=seed + 6),
        f"{prefix}post_attention_layernorm.weight": norm_weight(seed + 7),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = norm_weight(seed + 8)
    return out


def one_token_attention(t: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """Attention of a single token over itself: softmax over one key is 1, so it is
    ``o_proj`` of each query head's group value (rotary cancels out)."""
    v = (x @ t[f"{prefix}self_attn.v_proj.weight"].T).view(KV, HEAD_DIM)
    per_head = v.repeat_interleave(HEADS // KV, dim=0).reshape(-1)  # [HEADS * HEAD_DIM]
    return per_head @ t[f"{prefix}self_attn.o_proj.weight"].T


def mlp(t: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ t[f"{prefix}mlp.gate_proj.weight"].T, x @ t[f"{prefix}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ t[f"{prefix}mlp.down_proj.weight"].T


# -- EAGLE-3: speculators and SafeAILab -----------------------------------------------------------
DRAFT_IDS = torch.arange(3, VOCAB, 2)  # a draft vocabulary of 47 target tokens


def eagle3_tensors(prefix: str, seed: int = 10, embed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    s = DRAFT_IDS.numel()
    t = {"fc.weight": randn(H, 3 * H, seed=seed), "norm.weight": norm_weight(seed + 1),
         "lm_head.weight": randn(s, H, seed=seed + 2), "d2t": DRAFT_IDS - torch.arange(s),
         "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, DRAFT_IDS, True),
         f"{prefix}hidden_norm.weight": norm_weight(seed + 3),
         **llama_layer_tensors(prefix, 2 * H, seed + 10)}
    if embed is not None:
        t["embed_tokens.weight"] = embed.clone()
    return t


def layer_config(**extra) -> dict:
    """A one-layer Llama config of the draft's widths, as these projects write it."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": MLP,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": VOCAB,
            "hidden_act": "silu", "tie_word_embeddings": False, **extra}


def speculators_eagle3_config(norm_before_residual: bool | None, layer_ids: list[int] | None, steps: int = 5, **top):
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "transformer_layer_config": layer_config(), "draft_vocab_size": int(DRAFT_IDS.numel()),
           "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": layer_ids,
           "speculators_config": {"algorithm": "eagle3",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps}],
                                  "default_proposal_method": "greedy",
                                  "verifier": {"name_or_path": "tester/tiny-llama", "architectures": ["LlamaForCausalLM"]}},
           **top}
    if norm_before_residual is not None:
        cfg["norm_before_residual"] = norm_before_residual
    return cfg


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / name)
    return folder


def eagle3_reference(t: dict, prefix: str, embed: torch.Tensor, features: torch.Tensor, token: int,
                     norm_before_residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One EAGLE-3 draft step at one position, from the layout: returns the pre-norm output
    (the next step's feature) and the draft-vocabulary logits."""
    g = features @ t["fc.weight"].T
    normed = rms(g, t[f"{prefix}hidden_norm.weight"])
    x = torch.cat([rms(embed[token], t[f"{prefix}input_layernorm.weight"]), normed])
    h = (normed if norm_before_residual else g) + one_token_attention(t, prefix, x)
    out = h + mlp(t, prefix, rms(h, t[f"{prefix}post_attention_layernorm.weight"]))
    return out, rms(out, t["norm.weight"]) @ t["lm_head.weight"].T


def check_eagle3_step(heads, t: dict, prefix: str, model, norm_before_residual: bool) -> None:
    features = randn(1, 3 * H, seed=99, scale=1.0)
    embed = model.get_input_embeddings().weight.detach()
    out = heads(features, torch.tensor([7]), torch.tensor([0]), None, additive_mask(torch.ones(1, 1, dtype=torch.bool),
                                                                                      torch.float32))
    ref_out, ref_logits = eagle3_reference(t, prefix, embed, features[0], 7, norm_before_residual)
    torch.testing.assert_close(out[0], ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(heads.logits(out)[0], ref_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(heads.draft_vocab.cpu(), DRAFT_IDS)  # draft id i is target token i + d2t[i]


def decodes_exactly(target_folder: Path, model, heads_folder: Path, modes: tuple[str, ...]) -> None:
    engine = medusa.load(model=str(target_folder), heads=str(heads_folder), device="cpu", dtype="float32",
                         autotune=False)
    for seed, prompt in enumerate((PROMPT, [9, 4, 60, 33, 21])):
        ref = hf_greedy(model, prompt, 20)
        for mode in modes:
            assert engine.generate(prompt, max_new_tokens=20, mode=mode).tokens == ref, (heads_folder.name, mode, seed)


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_speculators_eagle3_loads_computes_its_layout_and_decodes_exactly(target, tmp_path, norm_before_residual):
    folder_target, model = target
    ids = [1, 4, 6]
    t = eagle3_tensors("layers.0.", embed=model.get_input_embeddings().weight.detach())
    ckpt = write_folder(tmp_path / "spec", speculators_eagle3_config(norm_before_residual, ids), t)
    assert published.detect(ckpt) == published.SPECULATORS_EAGLE3

    heads = load_heads_from(str(ckpt), model)
    cfg = heads.config
    assert (cfg.kind, cfg.feature_layers, cfg.draft_vocab_size, cfg.num_heads) == ("eagle3", ids, DRAFT_IDS.numel(), 5)
    assert cfg.norm_before_residual is norm_before_residual and cfg.base_model == "tester/tiny-llama"
    check_eagle3_step(heads, t, "layers.0.", model, norm_before_residual)
    decodes_exactly(folder_target, model, ckpt, ("eagle3", "hybrid"))


def test_speculators_eagle3_without_the_norm_flag_takes_vllm_s_default(target, tmp_path):
    """vLLM serves a speculators eagle3 config that lacks norm_before_residual with it true: so do we."""
    _, model = target
    t = eagle3_tensors("layers.0.")
    ckpt = write_folder(tmp_path / "spec", speculators_eagle3_config(None, [1, 4, 6]), t)
    heads = load_heads(ckpt, model)
    assert heads.config.norm_before_residual is True
    check_eagle3_step(heads, t, "layers.0.", model, True)


@pytest.mark.parametrize("key, value, message", [
    ("norm_before_fc", True, "norm_before_fc"),
    ("fc_norm", True, "fc_norm"),
    ("norm_output", True, "norm_output"),
    ("target_hidden_size", 128, "as wide as their target"),
    ("transformer_layer_config", layer_config(model_type="qwen3"), "qwen3 draft layer"),
    ("transformer_layer_config", layer_config(num_hidden_layers=2), "2 draft layers"),
])
def test_what_eagle3_heads_here_cannot_compute_gets_one_line(target, tmp_path, key, value, message):
    _, model = target
    ckpt = write_folder(tmp_path / "spec", {**speculators_eagle3_config(False, [1, 4, 6]), key: value},
                        eagle3_tensors("layers.0."))
    with pytest.raises(MedusaError, match=message) as err:
        load_heads(ckpt, model)
    assert "\n" not in str(err.value)


def test_eagle3_maps_that_disagree_are_refused(target, tmp_path):
    _, model = target
    t = eagle3_tensors("layers.0.")
    t["t2d"] = t["t2d"].clone()
    t["t2d"][DRAFT_IDS[0]] = False
    t["t2d"][0] = True
    ckpt = write_folder(tmp_path / "spec", speculators_eagle3_config(False, [1, 4, 6]), t)
    with pytest.raises(MedusaError, match="t2d does not mark"):
        load_heads(ckpt, model)
    t = eagle3_tensors("layers.0.", embed=torch.zeros(VOCAB, H))  # a draft embedding that is not the target's
    ckpt = write_folder(tmp_path / "embed", speculators_eagle3_config(False, [1, 4, 6]), t)
    with pytest.raises(MedusaError, match="embed_tokens differs from the target's"):
        load_heads(ckpt, model)


# -- exports round-trip -------------------------------------------------------------------------
def export_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_heads", REPO / "scripts" / "export_heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_heads(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def random_eagle3(model, seed: int = 2, **kw):
    from medusa.models.eagle3_heads import init_eagle3_for

    torch.manual_seed(seed)
    heads = init_eagle3_for(model, 5, vocab=DRAFT_IDS, **kw)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # every weight distinct from its initialisation
    return heads


def test_eagle3_speculators_export_is_the_format_and_round_trips(target, tmp_path, capsys):
    folder_target, model = target
    heads = random_eagle3(model)
    folder = save_heads(heads, tmp_path / "heads")
    out = tmp_path / "spec"
    assert export_script().main([str(folder), "--output", str(out), "--model", str(folder_target)]) == 0  # default layout
    printed = capsys.readouterr().out
    assert f"vllm serve {out}" in printed and "--speculative-config" not in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False  # written, not left to defaults
    assert (cfg["norm_before_fc"], cfg["fc_norm"], cfg["norm_output"]) == (False, False, False)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(heads.feature_layers) == [2, 4, 5]
    assert cfg["draft_vocab_size"] == DRAFT_IDS.numel()
    tl = cfg["transformer_layer_config"]
    assert (tl["model_type"], tl["num_hidden_layers"], tl["hidden_size"], tl["vocab_size"]) == ("llama", 1, H, VOCAB)
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"]["name_or_path"] == str(folder_target)  # what `vllm serve FOLDER` loads as the target
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], DRAFT_IDS) and "embed_tokens.weight" not in tensors

    back = load_heads(out, model)
    same_heads(back, heads)
    assert back.config.norm_before_residual is False and back.config.feature_layers == [2, 4, 5]
    decodes_exactly(folder_target, model, out, ("eagle3", "hybrid"))
    # the vllm layout (LlamaForCausalLMEagle3, this repo's names) reads back as SafeAILab's EAGLE-3
    assert export_script().main([str(folder), "--to", "vllm", "--output", str(tmp_path / "v"),
                                 "--model", str(folder_target)]) == 0
    assert published.detect(tmp_path / "v") == published.SAFEAILAB_EAGLE3
    same_heads(load_heads(tmp_path / "v", model), heads)


# -- Medusa: speculators and vLLM --------------------------------------------------------------
def speculators_medusa(folder: Path, shared: bool, bias: bool, heads: int = 3, layers: int = 2) -> tuple[Path, dict]:
    t = {}
    for k in range(heads):
        for j in range(layers):
            t[f"blocks.{k}.layers.{j}.weight"] = randn(H, H, seed=100 + 10 * k + j)
            if bias:
                t[f"blocks.{k}.layers.{j}.bias"] = randn(H, seed=200 + 10 * k + j)
        if not shared:
            t[f"lm_heads.{k}.weight"] = randn(VOCAB, H, seed=300 + k, scale=0.3)
    cfg = {"speculators_model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": heads,
           "num_hidden_layers": layers, "medusa_hidden_size": H, "medusa_vocab_size": VOCAB, "truncated_vocab_size": 0,
           "original_lm_head": shared, "medusa_fc_bias": bias,
           "speculators_config": {"algorithm": "medusa",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": heads}],
                                  "default_proposal_method": "greedy",
                                  "verifier": {"name_or_path": "tester/tiny-llama", "architectures": []}}}
    return write_folder(folder, cfg, t), t


def medusa_reference(t: dict, lm_head: torch.Tensor, hidden: torch.Tensor, heads: int, layers: int) -> torch.Tensor:
    """speculators' and vLLM's Medusa: per head ``x + SiLU(W x + b)`` per layer, then its projection."""
    out = []
    for k in range(heads):
        x = hidden
        for j in range(layers):
            b = t.get(f"blocks.{k}.layers.{j}.bias", torch.zeros(H))
            x = x + F.silu(x @ t[f"blocks.{k}.layers.{j}.weight"].T + b)
        out.append(x @ t.get(f"lm_heads.{k}.weight", lm_head).T)
    return torch.stack(out)


@pytest.mark.parametrize("shared, bias", [(True, False), (False, True)])
def test_speculators_medusa_loads_computes_its_layout_and_decodes_exactly(target, tmp_path, shared, bias):
    folder_target, model = target
    ckpt, t = speculators_medusa(tmp_path / "spec", shared, bias)
    assert published.detect(ckpt) == published.SPECULATORS_MEDUSA
    heads = load_heads_from(str(ckpt), model)
    assert heads.config.projection == ("shared" if shared else "per_head") and heads.config.num_layers == 2
    hidden = randn(4, H, seed=7, scale=1.0)
    lm_head = model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden), medusa_reference(t, lm_head, hidden, 3, 2), rtol=1e-5, atol=1e-5)
    decodes_exactly(folder_target, model, ckpt, ("medusa", "hybrid"))


def test_medusa_that_no_kind_here_imports_gets_one_line(target, tmp_path):
    _, model = target
    ckpt, t = speculators_medusa(tmp_path / "trunc", True, False)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": 32}))
    with pytest.raises(MedusaError, match="truncated vocabulary") as err:
        load_heads(ckpt, model)
    assert "\n" not in str(err.value)
    ckpt, _ = speculators_medusa(tmp_path / "lm", True, False)
    save_file({**load_file(ckpt / "model.safetensors"), "lm_head.weight": torch.zeros(VOCAB, H)}, ckpt / "model.safetensors")
    with pytest.raises(MedusaError, match="lm_head differs from the target's"):
        load_heads(ckpt, model)


@pytest.mark.parametrize("projection", ["shared", "per_head"])
def test_medusa_heads_round_trip_through_every_export(target, tmp_path, projection):
    folder_target, model = target
    heads = random_heads(model, projection=projection, num_layers=2, num_heads=3)
    folder = save_heads(heads, tmp_path / "heads")
    hidden = randn(4, H, seed=8, scale=1.0)
    with torch.no_grad():
        expected = heads(hidden)
    engine = medusa.load(model=str(folder_target), heads=str(folder), device="cpu", dtype="float32", autotune=False)
    tokens = engine.generate(PROMPT, max_new_tokens=20, mode="medusa").tokens
    for layout in ("speculators", "vllm", "fasterdecoding"):
        out = tmp_path / layout
        assert export_script().main([str(folder), "--to", layout, "--output", str(out), "--model", str(folder_target)]) == 0
        back = load_heads_from(str(out), model)
        assert back.config.projection == (projection if layout != "fasterdecoding" else "per_head"), layout
        with torch.no_grad():
            torch.testing.assert_close(back(hidden), expected, rtol=0, atol=1e-6)
        again = medusa.load(model=str(folder_target), heads=str(out), device="cpu", dtype="float32", autotune=False)
        assert again.generate(PROMPT, max_new_tokens=20, mode="medusa").tokens == tokens, layout
    cfg = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "medusa" and cfg["original_lm_head"] is (projection == "shared")
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(folder_target)


# -- SafeAILab EAGLE-3 and EAGLE-1/2 -------------------------------------------------------------
def safeailab_eagle3_config() -> dict:
    """As SafeAILab's EAGLE-3 checkpoints ship it: a Llama config of the draft, its draft
    vocabulary size, no target layers (they follow from the target's depth)."""
    return {**layer_config(architectures=["LlamaForCausalLMEagle3"]), "draft_vocab_size": int(DRAFT_IDS.numel())}


def test_safeailab_eagle3_loads_computes_its_layout_and_decodes_exactly(target, tmp_path):
    folder_target, model = target
    t = eagle3_tensors("midlayer.", embed=model.get_input_embeddings().weight.detach().half())  # float16, as shipped
    ckpt = write_folder(tmp_path / "ea3", safeailab_eagle3_config(), t)
    assert published.detect(ckpt) == published.SAFEAILAB_EAGLE3
    heads = load_heads_from(str(ckpt), model)
    # SafeAILab's layers for an n-layer target: 2, n // 2, n - 3; its residual adds the un-normed feature
    assert heads.config.feature_layers == [2, LAYERS // 2, LAYERS - 3] and heads.config.norm_before_residual is False
    check_eagle3_step(heads, t, "midlayer.", model, False)
    decodes_exactly(folder_target, model, ckpt, ("eagle3", "hybrid"))
    with pytest.raises(MedusaError, match="pass the target model") as err:
        read_heads(ckpt)  # without the target its layers are unknown
    assert "\n" not in str(err.value)


def safeailab_eagle_tensors(model, bias: bool, seed: int = 40) -> dict[str, torch.Tensor]:
    t = {"fc.weight": randn(H, 2 * H, seed=seed), **llama_layer_tensors("layers.0.", H, seed + 1, input_norm=False),
         "embed_tokens.weight": model.get_input_embeddings().weight.detach().clone()}
    if bias:
        t["fc.bias"] = randn(H, seed=seed + 20)
    return t


def eagle1_reference(t: dict, model, feature: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One EAGLE-1 draft step at one position, from SafeAILab's layout: ``fc(cat(embed, f))``, a
    decoder layer without its input norm, no final norm, the target's lm_head."""
    emb = model.get_input_embeddings().weight.detach()[token]
    x = torch.cat([emb, feature]) @ t["fc.weight"].T + t.get("fc.bias", torch.zeros(H))
    h = x + one_token_attention(t, "layers.0.", x)
    out = h + mlp(t, "layers.0.", rms(h, t["layers.0.post_attention_layernorm.weight"], model.config.rms_norm_eps))
    return out, out @ model.get_output_embeddings().weight.detach().T


@pytest.mark.parametrize("bias", [True, False])
def test_safeailab_eagle_loads_computes_its_layout_and_decodes_exactly(target, tmp_path, bias):
    folder_target, model = target
    t = safeailab_eagle_tensors(model, bias)
    ckpt = write_folder(tmp_path / "ea1", layer_config(bias=bias), t)
    assert published.detect(ckpt) == published.SAFEAILAB_EAGLE
    heads = load_heads_from(str(ckpt), model)
    assert (heads.config.kind, heads.config.eagle_layout, heads.config.fc_bias) == ("eagle", "eagle1", bias)
    feature = randn(1, H, seed=98, scale=1.0)
    out = heads(feature, torch.tensor([7]), torch.tensor([0]), None, additive_mask(torch.ones(1, 1, dtype=torch.bool),
                                                                                    torch.float32))
    ref_out, ref_logits = eagle1_reference(t, model, feature[0], 7)
    torch.testing.assert_close(out[0], ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(heads.logits(out)[0], ref_logits, rtol=1e-4, atol=1e-4)
    decodes_exactly(folder_target, model, ckpt, ("eagle", "hybrid"))


def test_eagle_heads_round_trip_through_the_vllm_export(target, tmp_path):
    """This repo's eagle1 heads export to vLLM's EAGLE-1 drafter, which is SafeAILab's layout: back identical."""
    from medusa.models.eagle_heads import init_eagle_for

    folder_target, model = target
    torch.manual_seed(4)
    heads = init_eagle_for(model, 4, init="random", layout="eagle1")
    folder = save_heads(heads, tmp_path / "heads")
    out = tmp_path / "v"
    assert export_script().main([str(folder), "--output", str(out), "--model", str(folder_target)]) == 0  # default: vllm
    assert published.detect(out) == published.SAFEAILAB_EAGLE
    same_heads(load_heads(out, model), heads)
    assert export_script().main([str(folder), "--to", "speculators", "--output", str(tmp_path / "s")]) == 1


def test_an_eagle_layer_of_another_shape_than_the_target_s_is_refused(target, tmp_path):
    _, model = target
    ckpt = write_folder(tmp_path / "ea1", layer_config(rms_norm_eps=1e-5), safeailab_eagle_tensors(model, False))
    with pytest.raises(MedusaError, match="rms_norm_eps"):
        load_heads(ckpt, model)


@pytest.mark.parametrize("config", [safeailab_eagle3_config(), layer_config(), None])
def test_pickled_weights_get_one_line_saying_how_to_convert(target, tmp_path, config):
    """Never unpickled: the file would run code if it were loaded (the payload proves the line
    comes before any load)."""
    _, model = target
    folder = tmp_path / "pickled"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    torch.save({"fc.weight": torch.zeros(2, 2), "x": Payload()}, folder / "pytorch_model.bin")
    for load in (lambda: load_heads_from(str(folder), model), lambda: load_heads(folder, model)):
        with pytest.raises(MedusaError, match="pickled weights only") as err:
            load()
        message = str(err.value)
        assert "\n" not in message and "weights_only=True" in message and "save_file" in message
    assert not marker.exists()


# -- the shipped heads, through every export and back ------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("kind, layouts", [("eagle3", ("speculators", "vllm")),
                                           ("medusa", ("speculators", "vllm", "fasterdecoding")),
                                           ("eagle", ("vllm",))])
def test_shipped_heads_round_trip_through_every_export(embedded, tmp_path, kind, layouts):
    from medusa.api import SHIPPED
    from medusa.bench.prompts import encode

    shipped = medusa.load(heads=kind, target=embedded, autotune=False)
    ids = encode(shipped, "Write a Python function that checks whether a number is prime.")
    mode = kind
    reference = shipped.generate(ids, max_new_tokens=48, mode="baseline").tokens
    assert shipped.generate(ids, max_new_tokens=48, mode=mode).tokens == reference
    for layout in layouts:
        out = tmp_path / layout
        assert export_script().main([str(SHIPPED[kind]), "--to", layout, "--output", str(out)]) == 0, layout
        back = medusa.load(heads=str(out), target=embedded, autotune=False)
        if layout != "fasterdecoding":  # that layout copies the shared lm_head into each head
            same_heads(back.heads, shipped.heads)
        for m in (mode, "hybrid"):
            assert back.generate(ids, max_new_tokens=48, mode=m).tokens == reference, (layout, m)
    if "speculators" in layouts:
        cfg = json.loads((tmp_path / "speculators" / "config.json").read_text())
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_vllm_check_serves_the_speculators_export_by_its_own_config(target, tmp_path):
    """scripts/vllm_check.py --layout speculators: the export names the served target as its
    verifier, and reads back as the same heads (vLLM itself is checked by make vllm-check)."""
    import importlib.util

    folder_target, model = target
    spec = importlib.util.spec_from_file_location("vllm_check", REPO / "scripts" / "vllm_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    heads = random_eagle3(model, seed=5)
    got = check.export_speculators(str(save_heads(heads, tmp_path / "h")), str(folder_target), "SERVED", tmp_path / "s")
    assert got == {"method": "eagle3", "model": str(tmp_path / "s"), "num_speculative_tokens": 5}
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "SERVED"
    assert load_file(tmp_path / "s" / "model.safetensors")["fc.weight"].dtype == torch.float32
    same_heads(load_heads(tmp_path / "s", model), heads)
