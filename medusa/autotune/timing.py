"""The target's pass cost ``T(n)``, measured: milliseconds of one pass over ``n`` new tree
nodes after a cached prefix, as an engine runs it. Tree sizing (trees.py, sizing.py) and the
dtype and kernel picks (device.py) read it.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from transformers import PreTrainedModel

from medusa.decoding.tree import compile_tree
from medusa.runtime import hf as kv
from medusa.runtime import native, packed, rows, screen

FILL_AFTER = 64  # a filled cache's positions prefilled for real (measure_cost's ``filled``)


@torch.inference_mode()
def measure_cost(model: PreTrainedModel, sizes: list[int], prefix: int = 256, reps: int = 9,
                 static_cache: bool = False, compile: bool | str = False, filled: bool = False) -> dict[int, float]:
    """Median milliseconds of one target pass over ``n`` new tree nodes after ``prefix``
    cached tokens, for each ``n`` in ``sizes`` (a star-shaped tree: cost depends on n only).

    Sizes are timed round-robin (``reps`` rounds after a warm-up round), so a slow spell of
    the machine spreads over every size instead of inflating one of them. ``static_cache``
    and ``compile`` time the pass as an engine built with them runs it (compiled in the
    warm-up round). ``filled``: where passes run as one call, the cached positions past the
    first 64 hold random keys and values written straight into the cache, not a prefill's (a
    row's attention costs the same whatever the keys hold; a prefill of 8k tokens takes half a
    minute on a small CPU).
    """
    return measure_costs({"": (model, contextlib.nullcontext())}, sizes, prefix, reps, static_cache, compile,
                         filled)[""]


def measure_costs(variants: dict[str, tuple[PreTrainedModel, contextlib.AbstractContextManager]], sizes: list[int],
                  prefix: int = 256, reps: int = 9, static_cache: bool = False,
                  compile: bool | str = False, filled: bool = False) -> dict[str, dict[int, float]]:
    """:func:`measure_cost` for several ``(model, scope)`` variants (a model in two dtypes, one
    model with two kernel scopes), each pass run inside its variant's (re-entrant) scope, timed round-robin
    over variants and sizes: a slow spell of the machine (a VM's speed drifts by half within
    minutes) then falls on every variant alike instead of deciding a comparison."""
    runs = {name: _pass_timer(model, scope, sizes, prefix, static_cache, compile, filled)
            for name, (model, scope) in variants.items()}
    samples: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in variants}
    for _ in range(reps + 1):
        for name, run in runs.items():
            for n in sizes:
                samples[name][n].append(run(n))
    return {name: {n: statistics.median(s[1:]) * 1e3 for n, s in by_n.items()} for name, by_n in samples.items()}


def _pass_timer(model: PreTrainedModel, scope: contextlib.AbstractContextManager, sizes: list[int], prefix: int,
                static_cache: bool, compile: bool | str, filled: bool = False):
    """A function timing one pass of ``n`` new nodes (seconds) after ``prefix`` cached tokens."""
    device = model.get_output_embeddings().weight.device
    vocab = model.config.vocab_size
    static = bool(static_cache or compile)
    forward = kv.compiled_forward(device, compile) if compile else kv.forward
    cache = kv.new_static_cache(model, prefix + max(sizes)) if static else kv.new_cache()
    width = kv.capacity(cache)
    one_call = not static and rows.supported(model) is None
    ran = min(prefix, FILL_AFTER) if filled and one_call else prefix
    ids = torch.randint(0, vocab, (1, ran), device=device)
    mask = kv.causal_mask(model, 0, ran, model.dtype, device, width) if static else None
    with scope:
        kv.forward(model, ids, torch.arange(ran, device=device)[None], cache, mask, logits_rows=slice(-1, None))
    if ran < prefix:
        _fill(cache, model, ran, prefix + max(sizes), prefix)
    through = native.forward if one_call and native.supported(model) is None else kv.forward
    # greedy rows' vocabulary screened, as the engine's passes do where the scope runs gemv kernels
    # (medusa/runtime/screen.py; it reads the whole lm_head under other kernels)
    screened = screen.for_model(model, "gemv") if one_call and device.type == "cpu" else None
    logits_by = {} if screened is None else {"vocab": screened.logits}
    setups = {}
    for n in sizes:
        tree = compile_tree([(i,) for i in range(n - 1)]).to(device)
        setups[n] = (tree, torch.randint(0, vocab, (1, n), device=device), (prefix + tree.depth)[None])

    def run(n: int) -> float:
        tree, tokens, positions = setups[n]
        with scope:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if one_call:  # as the engine's dynamic-cache passes run (PassStrategy._packed)
                layout = rows.layout_for(model, [(prefix, tree.ancestor, tree.depth)])
                logits, _ = packed.forward(model, tokens, positions, [packed.Segment(cache, slice(0, n), None)],
                                           layout=layout, through=through, starts=[prefix], **logits_by)
            else:
                mask = kv.tree_attention_mask(model, prefix, tree.ancestor, tree.depth, model.dtype, width) \
                    if static or n > 1 else None
                logits, _ = forward(model, tokens, positions, cache, mask)
            logits.argmax(-1).tolist()  # the step's host sync
            seconds = time.perf_counter() - t0
            kv.crop(cache, prefix)
        return seconds

    return run


def _fill(cache, model: PreTrainedModel, start: int, room: int, length: int) -> None:
    """Positions ``start`` .. ``length`` - 1 of a one-call pass's cache (room for ``room``) as random
    keys and values of the scale of real ones."""
    layers = packed.buffers(cache, kv.text_config(model).num_hidden_layers, room)
    if layers is None:
        raise ValueError("a filled cache needs the one-call passes' buffered layers")
    generator = torch.Generator().manual_seed(length)
    for keys, values in layers:
        for buffer in (keys, values):
            part = buffer[..., start:length, :]
            scale = float(buffer[..., :start, :].std())
            part.copy_(torch.randn(part.shape, generator=generator) * scale)
    packed.extend(cache, length)
