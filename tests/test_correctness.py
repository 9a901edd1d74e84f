"""No silent wrong tokens: logits computed as the model does, composite configs, refused architectures."""

import pytest
import torch
import transformers
from tiny import ARCHS, hf_greedy, tiny_model
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import medusa
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.models.loader import init_heads_for
from medusa.runtime import hf as kv

PROMPT = [5, 17, 33, 9, 41, 12]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("arch", ARCHS + ("gemma3_composite",))
def test_lm_logits_equal_the_models_own_logits(arch):
    # cohere scales by logit_scale, granite divides by logits_scaling, gemma3 softcaps;
    # the composite Gemma-3 class applies no softcap although its text config names one
    model = tiny_model(arch, seed=1)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        own = model(input_ids=ids).logits[0]
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
    torch.testing.assert_close(kv.lm_logits(model, hidden), own, atol=1e-5, rtol=1e-5)


def test_unknown_logit_post_processing_is_refused():
    model = tiny_model("llama")
    model.config.final_logit_softcapping = 5.0  # lm_logits would cap; LlamaForCausalLM does not
    with pytest.raises(MedusaError, match="post-processes its logits") as err:
        Engine(model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("static", [False, True])
def test_composite_gemma3_decodes_past_its_window_like_generate(static):
    # the window (8) lives only in the nested text config: a mask built from the top-level
    # config attends past it and diverges from generate after 8 tokens
    model = tiny_model("gemma3_composite", seed=1, sliding_window=8)
    assert getattr(model.config, "sliding_window", None) is None
    ref = hf_greedy(model, PROMPT, 30)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE, static_cache=static)
    for mode in ("baseline", "medusa", "lookup", "hybrid"):
        assert eng.generate(PROMPT, max_new_tokens=30, mode=mode).tokens == ref, mode


def test_composite_gemma3_context_window_comes_from_the_text_config():
    model = tiny_model("gemma3_composite", seed=1, max_position_embeddings=20)
    eng = Engine(model, heads=init_heads_for(model, num_heads=3), tree=TREE)
    assert eng.max_positions == 20
    res = eng.generate(PROMPT, max_new_tokens=50)
    assert res.finish_reason == "context" and len(PROMPT) + len(res.tokens) == 21


def _tiny(config_class, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=2, num_key_value_heads=1, **kw)
    return AutoModelForCausalLM.from_config(config).eval()


RECURRENT = {
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                           linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
                                           linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
                                           moe_intermediate_size=16, shared_expert_intermediate_size=16, head_dim=16)),
    "jamba": ("JambaConfig", dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                                  mamba_d_state=4, mamba_expand=1, use_mamba_kernels=False)),
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"])),
    "mamba": ("MambaConfig", dict(num_hidden_layers=2, state_size=4)),
}


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrent_architectures_are_refused(name):
    config_class, kw = RECURRENT[name]
    model = _tiny(config_class, **kw)
    with pytest.raises(MedusaError, match="cannot be verified in one pass") as err:
        Engine(model)
    assert "\n" not in str(err.value)


def test_medusa_load_refuses_a_recurrent_model_folder(tmp_path):
    config_class, kw = RECURRENT["qwen3_next"]
    _tiny(config_class, **kw).save_pretrained(tmp_path / "model")
    # load_target reads the tokenizer first: give the folder a minimal one
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.save_pretrained(tmp_path / "model")
    with pytest.raises(MedusaError, match="Qwen3NextForCausalLM has linear_attention layers"):
        medusa.load(model=str(tmp_path / "model"), device="cpu")


def test_chunked_attention_is_refused():
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                           intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16, num_local_experts=1,
                                           layer_types=["chunked_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(MedusaError, match="chunked_attention layers, an attention pattern the tree mask does not model"):
        Engine(model)
