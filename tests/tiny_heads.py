"""Helpers for the hub and export tests: a tiny target saved as a model folder (with a
tokenizer, so ``medusa.load(model=FOLDER)`` works) and heads with random, non-zero weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from tiny import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from medusa.models.heads import MedusaHeads
from medusa.models.loader import init_heads_for

REPO = Path(__file__).resolve().parent.parent
VOCAB = 96
PROMPT = [5, 17, 33, 9, 41, 12]


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def target_folder(root: Path, seed: int = 0) -> Path:
    """A tiny Llama saved with save_pretrained (safetensors) plus a word-level tokenizer."""
    folder = root / "target"
    model = tiny_model("llama", seed=seed, vocab_size=VOCAB)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def random_heads(model: torch.nn.Module, projection: str = "shared", num_layers: int = 1, num_heads: int = 3,
                 seed: int = 1, scale: float = 0.05) -> MedusaHeads:
    """Fresh heads moved off their initialisation by small noise: every weight is distinct
    (a wrong key mapping shows), yet the heads still guess right often enough on the tiny
    model's repetitive output that acceptance varies from step to step."""
    heads = init_heads_for(model, num_heads=num_heads, num_layers=num_layers, projection=projection)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return heads


def run_python(args: list[str], env: dict[str, str | None], timeout: int = 300) -> subprocess.CompletedProcess:
    """Run python with ``env`` applied to a copy of this process's environment (``None``
    removes a variable), from the repo root."""
    full = {**os.environ, **env}
    full = {k: v for k, v in full.items() if v is not None}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path
