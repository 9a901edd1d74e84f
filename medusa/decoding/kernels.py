"""Prepacked oneDNN linear layers for CPU passes: the same model, faster matmul kernels.

Why: a decoding pass of a small model on a CPU is its linear layers (81% of a SmolLM2-135M
one-token pass in float32, profiled), and torch's float32 ``F.linear`` on the CPU goes to
MKL, whose kernels are far from the memory bandwidth on some CPUs (on an AMD EPYC Zen 5 a
one-token pass ran ~1.4x faster, a 64-token pass ~1.8x, with oneDNN's). torch ships oneDNN
too; ``torch.ops.mkldnn._reorder_linear_weight`` packs a weight once into the blocked layout
its matmul kernels read and ``torch.ops.mkldnn._linear_pointwise`` multiplies by it (the ops
inductor's CPU fusion uses). torch's own bfloat16 ``F.linear`` calls the same oneDNN kernel
with the weight in its plain layout, so it repacks the weight at every call: on an AMX Xeon a
one-token pass's 211 bfloat16 linears took 29 ms that way and 21 ms prepacked, with results
bit-identical to torch's for 1-288 rows (not always above: see ``stock_above``). Packing with
``Tensor.to_mkldnn`` (plain layout, this module's first version) kept the repacking: 33 ms.

How: :class:`PackedLinears` holds a packed copy of every ``nn.Linear`` weight of the given
modules and, while entered, points each layer's ``forward`` at it; on exit the layers are
stock again. The engine enters it around its own passes only, so ``model.generate`` (the
bench's ``hf`` peer) and training never see it: nothing in the model is forked or replaced.
The packed copies double the memory of the linear weights, and they are a snapshot: weights
changed after packing (training, a LoRA merge) need a new ``PackedLinears``.

Compiled passes: inductor cannot lower a packed (opaque-layout) weight, so under
``torch.compile`` each packed layer calls the custom op ``medusa::packed_linear`` instead,
which inductor keeps as an extern call between the elementwise work it fuses (norms, rotary,
activations, residual adds). Eager passes call oneDNN directly (a custom op's dispatch costs
~5 us per call, ~1 ms over a pass of 211 linears).

Exactness: in float32 oneDNN rounds differently from MKL (both are within ~1e-6 of float64
here) and, like MKL, a row's result depends on the number of rows, so it is not bit-identical
to stock transformers; identity to ``generate`` is measured by the bench (README "oneDNN
linear kernels"). In bfloat16 torch's default is oneDNN's own kernel, so the packed layers
compute what stock transformers computes, bit for bit where measured. Whether they are used is
decided per device by timing, and for a half-precision model by the exactness probe too
(medusa/decoding/device.py).
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch
from torch import nn

KERNELS = ("default", "onednn")
PACKING_VERSION = 2  # 1: Tensor.to_mkldnn (plain layout); 2: _reorder_linear_weight (blocked). Part of cache keys.

# weight address -> the packed copies of that weight, newest last (one per live PackedLinears
# that packed it). Layers and the custom op find a packed copy by the weight itself, so neither
# the model nor a compiled graph holds an opaque-layout tensor or a per-layer constant: a
# compiled pass can be saved and loaded by another process (medusa/decoding/hf.py).
_PACKED: dict[int, list[tuple[int, torch.Tensor]]] = {}
_OWNERS = itertools.count()


def onednn_available(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build can run packed oneDNN linears in ``dtype`` on ``device`` (CPU
    only; bfloat16 also needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, absent on AVX2-only CPUs)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")):
        return False
    return _probe(dtype)


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    try:  # a build or CPU without these kernels raises here, not at the first pass
        one = torch.ones(2, 2, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(one[:1], pack(one), None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(out.float(), torch.full((1, 2), 2.0)))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in]) in oneDNN's blocked layout, once, for ``_linear_pointwise``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def packed_product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN with ``packed`` (:func:`pack` of ``weight``): the
    product every packed layer and the exactness probe (device.py) run."""
    try:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except RuntimeError:
        # oneDNN reports any failure, running out of memory included, as "could not create a
        # primitive"; the stock kernel either computes the layer or raises torch's own error
        # (e.g. "can't allocate memory"), which callers know how to report
        return nn.functional.linear(x, weight, bias)


@torch.library.custom_op("medusa::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the packed copy of ``weight`` a live PackedLinears holds."""
    return packed_product(x, packed_copy(weight), weight, bias)


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """The newest packed copy of ``weight`` (:class:`PackedLinears` registers them)."""
    copies = _PACKED.get(weight.data_ptr())
    if not copies:
        raise RuntimeError("no packed copy of this linear weight (it was replaced after packing): "
                           "make a new PackedLinears, or use kernels='default'")
    return copies[-1][1]


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _packed_forward(layer: nn.Linear, bias: torch.Tensor | None, stock_above: int | None,
                    x: torch.Tensor) -> torch.Tensor:
    if stock_above is not None and x.numel() > stock_above * x.shape[-1]:
        return nn.functional.linear(x, layer.weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.medusa.packed_linear(x, layer.weight, bias)
    return packed_product(x, packed_copy(layer.weight), layer.weight, bias)


def linear_layers(modules: list[nn.Module]) -> list[nn.Linear]:
    """Every float32/bfloat16 CPU ``nn.Linear`` in ``modules`` whose dtype this CPU packs
    (:func:`onednn_available`), each once (tied or shared layers appear in several)."""
    seen: dict[int, nn.Linear] = {}
    for module in modules:
        for layer in module.modules():
            w = layer.weight if isinstance(layer, nn.Linear) else None
            if w is not None and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) \
                    and onednn_available("cpu", w.dtype):  # else the layer keeps torch's kernel
                seen.setdefault(id(layer), layer)
    return list(seen.values())


class PackedLinears:
    """Inside ``with packed:``, the linear layers of ``modules`` run oneDNN with packed weights.

    ``stock_above``: inputs of more rows than this run the stock ``F.linear`` (a prompt's
    prefill). In bfloat16 the packed kernels matched torch's bit for bit for 1-288 rows on an
    AMX Xeon but not always above (the stock kernel changes strategy for large inputs: 576x576
    layers differed from 289 rows), so an engine that promises stock transformers' tokens
    packs only its decoding passes. Entering twice (nested) is allowed; the layers are
    restored when the outermost exits."""

    def __init__(self, *modules: nn.Module | None, stock_above: int | None = None) -> None:
        if not onednn_available():
            raise RuntimeError("this torch build has no oneDNN linear kernels: use kernels='default'")
        with torch.no_grad():
            self._packed = [(layer, pack(layer.weight.detach()), None if layer.bias is None else layer.bias.detach())
                            for layer in linear_layers([m for m in modules if m is not None])]
        owner = next(_OWNERS)
        for layer, packed, _ in self._packed:
            _PACKED.setdefault(layer.weight.data_ptr(), []).append((owner, packed))
        weakref.finalize(self, _release, owner, [layer.weight.data_ptr() for layer, _, _ in self._packed])
        # One forward per layer, made once: a compiled pass guards on each layer's forward, and a
        # new object at every entry would recompile it at every step.
        self._forwards = [functools.partial(_packed_forward, layer, bias, stock_above) for layer, _, bias in self._packed]
        self._depth = 0

    def __len__(self) -> int:
        return len(self._packed)

    def __enter__(self) -> PackedLinears:
        if self._depth == 0:
            for (layer, _, _), forward in zip(self._packed, self._forwards):
                layer.forward = forward
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            for layer, _, _ in self._packed:
                del layer.forward


def _release(owner: int, addresses: list[int]) -> None:
    for address in addresses:
        kept = [entry for entry in _PACKED.get(address, ()) if entry[0] != owner]
        if kept:
            _PACKED[address] = kept
        else:
            _PACKED.pop(address, None)
