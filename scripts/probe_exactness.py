"""Which ops of a decoder layer make a row of an n-row pass differ from a one-row pass.

For each op of a Llama-style layer (linear, SDPA, eager-style attention, the exact attention
of medusa/runtime/exact.py, RMSNorm, rotary, SiLU-gate) in bfloat16 and float32, prints
whether the rows of one call over n rows are bit-identical to n calls over one row each.
SmolLM2-135M's shapes (hidden 576, 9 query and 3 KV heads of 64). docs/exactness.md#exactness-in-bfloat16.

    python scripts/probe_exactness.py [--device cuda] [--dtypes bfloat16,float16,float32]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    LlamaConfig,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from medusa.config import HelpFormatter
from medusa.runtime.exact import exact_attention

HIDDEN, HEADS, KV_HEADS, DIM, PAST, ROWS = 576, 9, 3, 64, 256, 16


def report(name: str, full: torch.Tensor, single: torch.Tensor) -> None:
    diff = (full.float() - single.float()).abs().max().item()
    print(f"| {name} | {'yes' if torch.equal(full, single) else 'no'} | {diff:.3g} |")


def probe(dtype: torch.dtype) -> None:
    print(f"\n{dtype}\n\n| op | rows identical | max abs diff |\n|---|---|---|")
    x = torch.randn(64, HIDDEN, dtype=dtype)
    weight = torch.randn(3 * HIDDEN, HIDDEN, dtype=dtype) / 24
    one = torch.cat([F.linear(x[i:i + 1], weight) for i in range(64)])
    for n in (2, 4, 16, 64):
        report(f"linear, {n} rows vs 1", F.linear(x[:n], weight), one[:n])
    q = torch.randn(1, HEADS, ROWS, DIM, dtype=dtype)
    k = torch.randn(1, KV_HEADS, PAST + ROWS, DIM, dtype=dtype)
    v = torch.randn(1, KV_HEADS, PAST + ROWS, DIM, dtype=dtype)
    mask = torch.zeros(1, 1, ROWS, PAST + ROWS, dtype=dtype)
    for i in range(ROWS):
        mask[0, 0, i, PAST + i + 1:] = torch.finfo(dtype).min  # causal over the new rows
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    single = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], k, v, attn_mask=mask[:, :, i:i + 1],
                                                       enable_gqa=True) for i in range(ROWS)], 2)
    report(f"SDPA, query length {ROWS} vs 1", full, single)
    module = torch.nn.Module()
    full = exact_attention(module, q, k, v, mask)[0]
    single = torch.cat([exact_attention(module, q[:, :, i:i + 1], k[:, :, :PAST + i + 1], v[:, :, :PAST + i + 1], None)[0]
                        for i in range(ROWS)], 1)
    report(f"medusa_exact attention, {ROWS} tree rows vs 1 (own cache length)", full, single)
    norm = LlamaRMSNorm(HIDDEN).to(dtype)
    report(f"RMSNorm, {ROWS} rows vs 1", norm(x[:ROWS]), torch.cat([norm(x[i:i + 1]) for i in range(ROWS)]))
    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=DIM))
    pos = torch.arange(PAST, PAST + ROWS)[None]
    cos, sin = rope(x[None, :ROWS], pos)
    rotated = apply_rotary_pos_emb(q, q, cos, sin)[0]
    parts = [apply_rotary_pos_emb(q[:, :, i:i + 1], q[:, :, i:i + 1], *rope(x[None, i:i + 1], pos[:, i:i + 1]))[0]
             for i in range(ROWS)]
    report(f"rotary, {ROWS} rows vs 1", rotated, torch.cat(parts, 2))
    gate = torch.randn(ROWS, 1536, dtype=dtype)
    report(f"SiLU gate, {ROWS} rows vs 1", F.silu(gate) * gate, torch.cat([F.silu(g[None]) * g[None] for g in gate]))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/probe_exactness.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--device", default="cpu", help="where the ops run (cpu, cuda, ...)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated torch dtypes")
    return ap


if __name__ == "__main__":
    args = build_parser().parse_args()
    torch.set_default_device(args.device)  # every tensor and module below is made there
    torch.manual_seed(0)
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    for name in args.dtypes.split(","):
        probe(getattr(torch, name))
