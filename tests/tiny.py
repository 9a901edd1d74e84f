"""Tiny random causal LMs of every architecture the engine claims, built from configs."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)

ARCHS = ("llama", "qwen2", "mistral", "gemma3")


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
