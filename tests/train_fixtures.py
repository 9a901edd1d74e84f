"""Tiny real targets for training tests: a word-level fast tokenizer with a chat template
and a random Llama over its ~40-token vocabulary, saved as a normal model folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
EXTRA = ["user", "assistant", "system", "count", "from", "please", "ok", "\n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + EXTRA + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split on spaces but keep newlines and the chat markers as tokens of their own.
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.WhitespaceSplit(),
    ])
    core.add_special_tokens(SPECIAL)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_target(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama + tokenizer saved in ``folder`` (safetensors)."""
    tok = make_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def counting_conversation(start: int, length: int) -> dict:
    """User asks to count; the assistant counts cyclically: the future is a function of the present."""
    words = [WORDS[(start + i) % len(WORDS)] for i in range(length)]
    return {"messages": [{"role": "user", "content": f"count from {WORDS[start]} please"},
                         {"role": "assistant", "content": " ".join(words)}]}


def write_counting_data(path: Path, n: int, seed: int = 0, length: int = 24) -> Path:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            fh.write(json.dumps(counting_conversation(rng.randrange(len(WORDS)), length)) + "\n")
    return path
