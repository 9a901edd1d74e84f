"""Can a compiled bfloat16 pass round exactly as the eager one does? docs/performance.md#where-a-decode-steps-time-goes.

Compiles a Llama-family target with inductor's ``emulate_precision_casts`` (bfloat16 roundings
kept between fused ops) and compares it with eager, bit for bit: a prompt pass, then one-token
decoding steps over a static cache, timed interleaved. ``--opaque`` hides the RMSNorm's mean of
squares (the engine's ``medusa::mean_square``) and SDPA behind custom ops, so that eager's kernels
compute them (inductor's own reduction and its lowering of masked SDPA round otherwise). A probe
with torch's SDPA and linear kernels; the engine's compiled exact passes
(docs/compile.md#compiled-exact-passes) are built on what it found. It patches the model's norm class and attention while it runs.

    python scripts/probe_compiled.py [--model M] [--opaque] [--prefix 200] [--steps 29]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from transformers import AttentionInterface, StaticCache

import medusa
from medusa.config import HelpFormatter, count
from medusa.runtime.opaque import OpaqueRMSNorm


@torch.library.custom_op("medusa_probe::sdpa", mutates_args=())
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    causal = mask is None and q.shape[2] > 1  # transformers leaves a plain causal mask out
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal,
                                                            enable_gqa=True)


@sdpa.register_fake
def _(q, k, v, mask, scale):
    return torch.empty_like(q)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return torch.ops.medusa_probe.sdpa(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


AttentionInterface.register("medusa_probe_sdpa", _attention)


@contextlib.contextmanager
def opaque(model):
    """Inside: the model's RMSNorm reduction and attention run through the probe's custom ops."""
    norm = type(model.get_decoder().norm)
    if not hasattr(model.get_decoder().norm, "variance_epsilon"):
        raise SystemExit(f"--opaque patches Llama-style RMSNorm; {norm.__name__} is not one")
    forward, attention = norm.forward, model.config._attn_implementation
    norm.forward = OpaqueRMSNorm.forward  # Llama's RMSNorm, its reduction by eager's kernel when compiled
    model.config._attn_implementation = "medusa_probe_sdpa"
    try:
        yield model
    finally:
        norm.forward = forward
        model.config._attn_implementation = attention


def prompt_pass(model, n: int) -> int:
    """Differing logits between the eager and the compiled pass over ``n`` prompt tokens."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        return int((model(input_ids=ids).logits != torch.compile(model, dynamic=False)(input_ids=ids).logits).sum())


def decode_steps(model, prefix: int, steps: int) -> tuple[int, float, float]:
    """Greedy one-token steps, eager and compiled side by side on two static caches: (differing
    logits over all steps, eager ms, compiled ms; medians)."""
    ids = torch.randint(0, model.config.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, dynamic=False)

    def step(fn, cache, token, pos):
        return fn(input_ids=token, past_key_values=cache, cache_position=torch.tensor([pos]),
                  position_ids=torch.tensor([[pos]]), use_cache=True).logits

    torch._dynamo.reset()
    differing, eager_s, compiled_s = 0, [], []
    with torch.no_grad():
        caches = []
        for _ in range(2):
            caches.append(StaticCache(config=model.config, max_cache_len=prefix + steps + 1))
            model(input_ids=ids, past_key_values=caches[-1], cache_position=torch.arange(prefix), use_cache=True)
        token = ids[:, -1:]
        for i in range(steps):
            t0 = time.perf_counter()
            eager = step(model, caches[0], token, prefix + i)
            t1 = time.perf_counter()
            comp = step(compiled, caches[1], token, prefix + i)
            t2 = time.perf_counter()
            if i:  # the first compiled step traces
                eager_s.append(t1 - t0)
                compiled_s.append(t2 - t1)
            differing += int((eager != comp).sum())
            token = eager[:, -1:].argmax(-1)
    return differing, statistics.median(eager_s) * 1e3, statistics.median(compiled_s) * 1e3


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/probe_compiled.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None, help="a Llama-family target (default: the embedded one)")
    ap.add_argument("--opaque", action="store_true", help="the norm's reduction and attention by eager's kernels")
    ap.add_argument("--prompt-tokens", type=count(1), default=40, help="tokens of the compared prompt pass")
    ap.add_argument("--prompt", dest="prompt_tokens", type=count(1), help=argparse.SUPPRESS)  # the old spelling
    ap.add_argument("--prefix", type=count(1), default=200, help="tokens in the cache before the decoding steps")
    ap.add_argument("--steps", type=count(2), default=29, help="decoding steps compared")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    inductor_config.emulate_precision_casts = True
    model = medusa.load(model=args.model, dtype="bfloat16", kernels="default").model
    model.config._attn_implementation = "sdpa"
    with opaque(model) if args.opaque else contextlib.nullcontext():
        print(f"prompt pass ({args.prompt_tokens} tokens): {prompt_pass(model, args.prompt_tokens)} differing logits")
        differing, eager_ms, compiled_ms = decode_steps(model, args.prefix, args.steps)
    print(f"{args.steps} decoding steps after {args.prefix} tokens: {differing} differing logits; "
          f"eager {eager_ms:.1f} ms, compiled {compiled_ms:.1f} ms a step (medians, interleaved)")


if __name__ == "__main__":
    main()
