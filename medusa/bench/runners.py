"""The bench's modes other than the engine's own, by name: transformers' ``generate`` as a user
runs it (plain, in another dtype, compiled, assisted, prompt lookup) and the vLLM and llama.cpp
peers. ``mode(name)`` registers a runner in ``MODES``; engine modes are parsed, not registered
(``medusa.bench.modes.mode_spec``)."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from transformers import CompileConfig, GenerationConfig, StaticCache

from medusa.bench import llamacpp_peer, vllm_peer
from medusa.bench.records import Bench, Run
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.runtime import hf as kv

Runner = Callable[[Engine, list[int], Bench], Run]
MODES: dict[str, Runner] = {}  # registered at import; ENGINE_MODES with suffixes are parsed (mode_spec)


def mode(name: str) -> Callable[[Runner], Runner]:
    def register(fn: Runner) -> Runner:
        MODES[name] = fn
        return fn

    return register


def _hf_config(engine: Engine, bench: Bench, **extra) -> GenerationConfig:
    eos = sorted(engine.eos) or None
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return GenerationConfig(max_new_tokens=bench.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                            **{**bench.sampling.hf_generate_kwargs(), **extra})


def hf_generate(engine: Engine, ids: list[int], config: GenerationConfig, model=None, **kwargs) -> Run:
    """``generate`` on the engine's target (or on ``model``, another copy of it), timed."""
    x = torch.tensor([ids], device=engine.device)
    _sync(engine)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = (engine.model if model is None else model).generate(x, attention_mask=torch.ones_like(x), generation_config=config, **kwargs)
    _sync(engine)
    seconds = time.perf_counter() - t0
    return Run(tokens=out[0, len(ids):].tolist(), seconds=seconds)


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


@mode("hf")
def run_hf(engine: Engine, ids: list[int], bench: Bench, model=None) -> Run:
    """transformers ``generate`` on the engine's target, or on ``model`` (another copy of it)."""
    if not bench.sampling.greedy and bench.sampling.seed is not None:
        torch.manual_seed(bench.sampling.seed)  # transformers samples from the global generator
    run = hf_generate(engine, ids, _hf_config(engine, bench), model=model)
    run.steps = len(run.tokens)
    return run


PLAIN_DTYPES = ("float32", "bfloat16")  # hf-float32, hf-bfloat16: transformers as a user loads the target


def run_hf_as_loaded(engine: Engine, ids: list[int], bench: Bench, *, dtype: str) -> Run:
    """transformers ``generate`` on the target as a user loads it for transformers alone: its
    own copy in ``dtype`` with transformers' default attention and torch's kernels. ``hf``
    runs the engine's own target, in the engine's dtype, with its attention (batch-invariant
    in half precision); on a device where another dtype or attention runs ``generate``
    faster, that is the speed a user would compare with."""
    return run_hf(engine, ids, bench, model=bench.plain_targets[dtype])


for _dtype in PLAIN_DTYPES:
    mode(f"hf-{_dtype}")(functools.partial(run_hf_as_loaded, dtype=_dtype))


def plain_targets(modes: list[str], args: argparse.Namespace, device: torch.device) -> dict[str, torch.nn.Module]:
    """The copies of the target that the hf-DTYPE modes run, loaded before any timing."""
    from medusa.models.target import load_target

    wanted = [d for d in PLAIN_DTYPES if f"hf-{d}" in modes]
    if "bfloat16" in wanted and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise MedusaError("mode hf-bfloat16 needs bfloat16, which this GPU lacks: drop it")
    return {d: load_target(args.model, device=device, dtype=d)[0] for d in wanted}


HF_STATIC_MIN = 2048  # hf-compile's cache slots: one size for every prompt, so generate compiles once


@mode("hf-compile")
def run_hf_compile(engine: Engine, ids: list[int], bench: Bench) -> Run:
    """transformers ``generate`` as a user would compile it: its own fixed-size ``StaticCache``
    and its ``torch.compile``'d decoding forward (``CompileConfig``; allowed on every device).
    The cache has ``HF_STATIC_MIN`` slots (a power of two above that for longer runs), so one
    graph serves every prompt; it is compiled in the bench's warm-up, outside the timing."""
    need = len(ids) + bench.max_new_tokens
    size = max(HF_STATIC_MIN, 1 << (need - 1).bit_length())
    if engine.max_positions is not None:
        size = min(size, engine.max_positions)
    cache = StaticCache(config=engine.model.config, max_cache_len=size)
    compiled = CompileConfig(fullgraph=False, mode="default" if engine.device.type != "cuda" else "reduce-overhead")
    compiled._compile_all_devices = True  # transformers compiles on CUDA only unless this is set
    run = hf_generate(engine, ids, _hf_config(engine, bench, compile_config=compiled),
                      **kv.cache_kwarg(engine.model.forward, cache))  # generate takes the model's name
    run.steps = len(run.tokens)
    return run


@mode("hf-assisted")
def run_hf_assisted(engine: Engine, ids: list[int], bench: Bench) -> Run:
    """transformers' assisted generation with the same draft and draft length as ``draft``."""
    if engine.draft is None:
        raise MedusaError("mode hf-assisted needs a draft: pass --draft FOLDER_OR_HUB_ID (or --draft default)")
    cfg = engine.proposer_config
    schedule = "heuristic" if cfg.adaptive_draft else "constant"
    settings = dict(num_assistant_tokens=cfg.draft_tokens, num_assistant_tokens_schedule=schedule,
                    assistant_confidence_threshold=cfg.draft_confidence)
    # transformers reads these from the assistant's own generation config too (where the
    # confidence stop otherwise defaults to 0.4): set both, so both modes draft alike.
    for name, value in settings.items():
        setattr(engine.draft.generation_config, name, value)
    return hf_generate(engine, ids, _hf_config(engine, bench, **settings), assistant_model=engine.draft)


@mode("prompt-lookup")
def run_prompt_lookup(engine: Engine, ids: list[int], bench: Bench) -> Run:
    """transformers' prompt lookup decoding with the same settings as ``lookup``."""
    config = _hf_config(engine, bench, prompt_lookup_num_tokens=engine.proposer_config.chain(),
                        max_matching_ngram_size=engine.proposer_config.lookup_ngram)
    return hf_generate(engine, ids, config)


# vLLM as a peer: vllm, vllm-ngram, vllm-heads, vllm-eagle and vllm-eagle3, each a long-lived worker in vLLM's own venv.
vllm_peer.register(mode, Run)
# llama.cpp as a peer: llamacpp and llamacpp-lookup, a long-lived llama-cpp-python worker on an F32 GGUF.
llamacpp_peer.register(mode, Run)


def close_peers() -> None:
    """Stop the peers' workers: they belong to one run (its model and settings)."""
    vllm_peer.close_all()
    llamacpp_peer.close_all()
