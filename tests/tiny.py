"""Tiny random causal LMs of every architecture the engine claims, built from configs."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma3Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    SiglipVisionConfig,
)

from medusa.decoding.proposers.factory import ProposerConfig

# cohere and granite post-process their logits (logit_scale, logits_scaling), gemma3
# softcaps them and mixes sliding-window and full layers.
ARCHS = ("llama", "qwen2", "mistral", "gemma3", "cohere", "granite")
WINDOWED = ("qwen2", "mistral", "gemma3")  # the ones tiny_config gives a sliding window

# Every step drafts: on a tiny target the heads cost about what its passes do, so a lone sequence's
# check of whether drafting pays (medusa/decoding/payoff.py) soon decodes plainly there; the tests
# of the drafts themselves (what they propose, keep and cost) turn it off with this config.
# draft every step, lookup chains of a fixed length (the same proposals whatever a plan timed)
DRAFTING = ProposerConfig(check_drafting=False, match_chains=False)


def tiny_config(arch: str, vocab_size: int = 96, sliding_window: int | None = None, **overrides):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        if sliding_window:
            common.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
        return Qwen2Config(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=sliding_window, **common)
    if arch == "gemma3":
        common.update(head_dim=16, sliding_window=sliding_window or 512, num_hidden_layers=3,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                      final_logit_softcapping=30.0)
        return Gemma3TextConfig(**common)
    if arch == "gemma3_composite":
        # Gemma-3 4B and up: a vision-language model whose text settings (window, layer
        # types, context, softcap) live in the nested text config only.
        # Untied: with tied random embeddings and no softcap (the composite class applies
        # none) greedy decoding only repeats the last token.
        text = tiny_config("gemma3", vocab_size, sliding_window, **{"tie_word_embeddings": False, **overrides})
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                            image_token_index=vocab_size - 1, boi_token_index=vocab_size - 2,
                            eoi_token_index=vocab_size - 3, tie_word_embeddings=False)
    if arch == "cohere":
        return CohereConfig(logit_scale=0.5, **common)  # logits multiplied by 0.5
    if arch == "granite":
        return GraniteConfig(logits_scaling=4.0, **common)  # logits divided by 4
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, **kwargs) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs), dtype=torch.float32)
    # Larger-than-default weights make the random model's logits peaked enough that
    # greedy decoding has clear winners (and repeats, so heads get both hits and misses).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def hf_greedy(model: PreTrainedModel, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of ``ids`` (``n`` tokens, EOS id 2): the reference."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=2, pad_token_id=0)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         generation_config=config)
    return out[0, len(ids):].tolist()
