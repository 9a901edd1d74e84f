"""Prepacked linear layers for CPU passes: the same model, faster matmul kernels (oneDNN's, or
for float32 layers this package's gemv kernels, medusa/runtime/gemv.py: ``kernels="gemv"``).

Why: a decoding pass of a small model on a CPU spends the largest share of its time in its
linear layers (profiled: docs/performance.md#where-a-pass-goes), and torch's float32 ``F.linear``
on the CPU goes to MKL, whose kernels are far from the memory bandwidth on some CPUs, where whole
passes run markedly faster with oneDNN's (docs/performance.md#linear-kernels-per-cpu-mkl-or-onednn). torch ships oneDNN
too; ``torch.ops.mkldnn._reorder_linear_weight`` packs a weight once into the blocked layout
its matmul kernels read and ``torch.ops.mkldnn._linear_pointwise`` multiplies by it (the ops
inductor's CPU fusion uses). torch's own bfloat16 ``F.linear`` calls the same oneDNN kernel
with the weight in its plain layout, so it repacks the weight at every call, which prepacking
saves, with results bit-identical to torch's up to a few hundred rows (not always above: see
``stock_above``; docs/performance.md#linear-kernels-per-cpu-mkl-or-onednn).

How: :class:`PackedLinears` holds a packed copy of every ``nn.Linear`` weight of the given
modules and, while entered, points each layer's ``forward`` at it; on exit the layers are
stock again. The engine enters it around its own passes only, so ``model.generate`` (the
bench's ``hf`` peer) and training never see it: nothing in the model is forked or replaced.
The packed copies double the memory of the linear weights and are a snapshot: weights changed
after packing (training, a LoRA merge) need a new ``PackedLinears``.

Stacked siblings: the layers a decoder layer calls on one input (q/k/v, gate/up) run as one
product of their stacked packed weights, each taking its slice (:class:`_Siblings`): 90 of the
embedded model's 211 products fewer per pass, bit-identical to the separate ones where used.

Compiled passes: inductor cannot lower a packed (opaque-layout) weight, so under
``torch.compile`` each packed layer calls the custom op ``medusa::packed_linear`` instead
(stacked siblings ``medusa::stacked_linear``), an extern call between the elementwise work it
fuses. Eager passes call the kernels directly (a custom op's dispatch adds a fixed cost to each
of a pass's ~200 calls).

A kernel per pass size: ``kernels="gemv>3"`` runs products of 1-3 rows by torch's own kernel
and larger ones by gemv. On some CPUs torch's float32 kernel (MKL) is the cheaper for a
one-token pass but leaves the bandwidth from a few rows on, where gemv stays near it
(docs/performance.md#a-kernel-per-pass-size-2026-11-29): a split takes the cheaper kernel at each
size, and the machine plan picks it by the same timing as the others (medusa/autotune/device.py:
``decide_kernels``).

Exactness: in float32 oneDNN and gemv round differently from MKL (all within ~1e-6 of float64
where measured), so they are not bit-identical to stock transformers; identity to ``generate`` is measured
by the bench (docs/performance.md#linear-kernels-per-cpu-mkl-or-onednn). In bfloat16 torch's
default is oneDNN's own kernel, so packed layers compute what stock transformers computes, bit
for bit where measured. The kernels are picked per device by timing, in half precision after
the exactness probe too (medusa/autotune/device.py).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import weakref
from pathlib import Path

import torch
from torch import nn

from medusa.runtime import clock, gemv

KERNELS = ("default", "onednn", "gemv")
PACKED = ("onednn", "gemv")  # the kernels PackedLinears runs
# 1: Tensor.to_mkldnn (plain layout); 2: _reorder_linear_weight (blocked); 3: sibling layers
# (q/k/v, gate/up) stacked into one product (_Siblings); 4: the gemv kernels (float32 layers,
# medusa/runtime/gemv.py) join the pick; 5: gemv prefetches under products of 7+ rows; 6: the
# pick times 1-16 rows and may split kernels by pass size ("gemv>3"); 7: passes are timed as
# the engine runs them (one-call attention, whole one-call passes on gemv); 8: the one-call
# attention splits long key lists into chunks (cheaper rows at long context); 9: bfloat16 heads on
# gemv and the EAGLE-3 drafter layer in one call (cheaper drafting, so other sizes); 10: greedy
# passes screen the vocabulary in bfloat16 (medusa/runtime/screen.py), so other costs; 11: the C
# kernels' vector loads are single moves (on AVX2 they stalled: attention 10-18x slower, so every
# size timed there was off); 12: the attention's blocks inline per head size, its scores' key
# sums side by side (same bits, a pass at long context 1.3-1.6x faster there, so other sizes);
# 13: on AVX2 a bfloat16 weight is widened by one load and a shift (the heads' products, their
# draft vocabulary and the vocabulary screen 1.3-1.5x faster there, same bits). Cache keys.
PACKING_VERSION = 13
# layers one module calls on the same input, in transformers' decoder layers (attention, MLP)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
FUSED_ROWS = 32  # half precision: stacked products for inputs of at most this many rows (_Siblings)

# weight address -> the packed copies of that weight, newest last (one per live PackedLinears
# that packed it). Layers and the custom op find a packed copy by the weight itself, so neither
# the model nor a compiled graph holds an opaque-layout tensor or a per-layer constant: a
# compiled pass can be saved and loaded by another process (medusa/runtime/hf.py).
_PACKED: dict[int, list[tuple[int, torch.Tensor]]] = {}
# first sibling's weight address -> the stacked products (_Siblings) of that group, likewise
_STACKED: dict[int, list[tuple[int, _Siblings]]] = {}
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


def split_kernels(kernels: str) -> tuple[str, int | None]:
    """``(kernels, stock_rows)`` of a kernels name: ``"gemv>3"`` is ``("gemv", 3)``, gemv for
    products of more than 3 rows and torch's own kernel for 1-3; a plain name splits nothing
    (``None``). ValueError (one line) for a name that is neither."""
    base, split, rows = kernels.partition(">")
    if base not in KERNELS or (split and (base not in PACKED or not rows.isdigit() or int(rows) < 1)):
        raise ValueError(f"unknown kernels {kernels!r}: use one of {', '.join(KERNELS)}, or a packed one for "
                         "passes above some rows, torch's below (e.g. 'gemv>3')")
    return base, int(rows) if split else None


def kernels_arg(value: str) -> str:
    """``--kernels`` for argparse: a name :func:`split_kernels` takes, else a one-line usage error."""
    try:
        split_kernels(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def kernels_key(kernels: str) -> str:
    """``kernels`` as cache keys name it: packed ones carry :data:`PACKING_VERSION`, so a pick or
    a size measured with another packing is measured again."""
    return f"{kernels}-p{PACKING_VERSION}" if split_kernels(kernels)[0] in PACKED else kernels


def stock(x: torch.Tensor, stock_above: int | None, stock_rows: int | None) -> bool:
    """Whether a product of ``x`` runs torch's own kernel: more rows than ``stock_above`` (a
    prompt's prefill) or at most ``stock_rows`` (a split's small passes, :func:`split_kernels`)."""
    width = x.shape[-1]
    return (stock_above is not None and x.numel() > stock_above * width) or \
        (stock_rows is not None and x.numel() <= stock_rows * width)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in]) in oneDNN's blocked layout, once, for ``_linear_pointwise``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def kind_of(kernels: str, weight: torch.Tensor) -> str:
    """Which kernel runs ``weight``'s layer under ``kernels``: "gemv" takes float32 layers and
    bfloat16 ones (heads drafting in bfloat16 beside a float32 target: the weight read at half
    the bytes, each product in float32; medusa/runtime/gemv.py), else oneDNN."""
    return "gemv" if kernels == "gemv" and weight.dtype in (torch.float32, torch.bfloat16) else "onednn"


def pack_as(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed for the kernel ``kind`` ("onednn" or "gemv")."""
    return gemv.pack(weight) if kind == "gemv" else pack(weight)


def run_packed(kind: str, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel ``kind`` with ``packed = pack_as(kind, weight)``."""
    if kind == "gemv":
        if x.dtype != weight.dtype or x.device.type != "cpu":
            return nn.functional.linear(x, weight, bias)
        return gemv.product(x, packed, weight.shape[0], bias)
    return packed_product(x, packed, weight, bias)


def packed_product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN with ``packed`` (:func:`pack` of ``weight``): the
    product every packed layer and the exactness probe (medusa/autotune/device.py) run."""
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
    kind, packed = packed_copy(weight)
    return run_packed(kind, x, packed, weight, bias)


@torch.library.custom_op("medusa::stacked_linear", mutates_args=())
def stacked_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """The stacked product ``[..., out_features]`` of the sibling layers (:class:`_Siblings`)
    whose first layer's weight is ``weight``, as a live PackedLinears registered them. Each
    sibling's call in a compiled pass asks for it with the same arguments, and the compiler's
    common-subexpression pass keeps one call: one product per group, each layer its slice."""
    stacked = _STACKED.get(weight.data_ptr())
    if not stacked:
        raise RuntimeError("no stacked product of these linear layers (they were replaced after packing): "
                           "make a new PackedLinears, or use kernels='default'")
    return stacked[-1][1].product(x)


@stacked_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class MergeStacked:
    """An inductor graph pass (``post_grad_custom_pre_pass``) that keeps one call of each
    ``medusa::stacked_linear`` with the same arguments: the siblings of a group each ask for
    their stacked product, and inductor's inference graphs get no common-subexpression pass of
    their own. Without it a compiled pass multiplied q/k/v's stacked weights three times."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        target = torch.ops.medusa.stacked_linear.default
        first: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not target:
                continue
            key = (node.args, tuple(sorted(node.kwargs.items())))
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node

    def uuid(self) -> bytes:
        """For inductor's caches: this module's source (the pass and the op it merges)."""
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


def packed_copy(weight: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The newest packed copy of ``weight`` and its kernel (:class:`PackedLinears` registers them)."""
    copies = _PACKED.get(weight.data_ptr())
    if not copies:
        raise RuntimeError("no packed copy of this linear weight (it was replaced after packing): "
                           "make a new PackedLinears, or use kernels='default'")
    return copies[-1][1:]


def gemv_copy(layer: nn.Linear, rows: int) -> torch.Tensor | None:
    """``layer``'s float32 gemv copy where a product of ``rows`` rows runs it now (inside a
    :class:`PackedLinears` scope, not a stock product there), else None."""
    forward = layer.__dict__.get("forward")
    if not isinstance(forward, functools.partial) or forward.func is not _packed_forward:
        return None
    _, bias, stock_above, stock_rows = forward.args
    if stock(torch.empty(rows, 1), stock_above, stock_rows):
        return None
    kind, packed = packed_copy(layer.weight)
    return packed if kind == "gemv" and packed.dtype == torch.float32 else None


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _packed_forward(layer: nn.Linear, bias: torch.Tensor | None, stock_above: int | None, stock_rows: int | None,
                    x: torch.Tensor) -> torch.Tensor:
    if stock(x, stock_above, stock_rows):
        return nn.functional.linear(x, layer.weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.medusa.packed_linear(x, layer.weight, bias)
    kind, packed = packed_copy(layer.weight)
    return clock.charged("linears", run_packed, kind, x, packed, layer.weight, bias)


def linear_layers(modules: list[nn.Module], kernels: str = "onednn") -> list[nn.Linear]:
    """Every float32/bfloat16 CPU ``nn.Linear`` in ``modules`` whose dtype this CPU packs for
    ``kernels`` (:func:`kind_of`: oneDNN where :func:`onednn_available`, gemv for float32
    layers), each once (tied or shared layers appear in several)."""
    seen: dict[int, nn.Linear] = {}
    for module in modules:
        for layer in module.modules():
            w = layer.weight if isinstance(layer, nn.Linear) else None
            if w is None or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
                continue
            if kind_of(kernels, w) == "gemv" or onednn_available("cpu", w.dtype):  # else torch's kernel
                seen.setdefault(id(layer), layer)
    return list(seen.values())


class _Siblings:
    """Linear layers of one module that read the same input, as one product: transformers'
    decoder layers call ``q_proj``, ``k_proj`` and ``v_proj`` on one tensor, and ``gate_proj``
    and ``up_proj`` on another. Whichever layer is called first multiplies the input by their
    stacked packed weights and keeps the other layers' slices of the product for their calls
    with that same tensor; a call with any other input multiplies again.

    Why: a one-token pass is ~200 small products, each with a fixed cost beside its weights'
    bandwidth (a stacked product costs far less than its parts called one by one:
    docs/performance.md#stacked-siblings-2026-11-27), so stacking q/k/v and gate/up saves 90 of the
    embedded model's 211 calls. Each output element is still one row's dot product over the
    same inputs: the stacked product was bit-identical to the separate ones, and to torch's
    own kernels, for 1-39 rows in bfloat16 and for any rows in float32 (measured; not
    for 64+ rows in bfloat16 with some shapes). So in half precision it is used for at most
    ``FUSED_ROWS`` rows, and larger inputs run torch's own kernels layer by layer (a short
    prompt's prefill); the exactness probe (medusa/autotune/device.py) checks the passes the engine runs."""

    def __init__(self, layers: list[nn.Linear], max_rows: int | None, kind: str = "onednn",
                 stock_rows: int | None = None) -> None:
        with torch.no_grad():
            self.packed = pack_as(kind, torch.cat([layer.weight.detach() for layer in layers]))
            self.bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
        self.kind = kind
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.max_rows = max_rows
        self.stock_rows = stock_rows  # inputs of at most this many rows: torch's kernel, layer by layer
        self._input: torch.Tensor | None = None  # held until every slice is taken, so its id stays its own
        self._version: int | None = None
        self._parts: list[torch.Tensor | None] = []

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        if stock(x, self.max_rows, self.stock_rows):
            return nn.functional.linear(x, layer.weight, layer.bias)
        if torch.compiler.is_compiling():  # one call per group after the compiler's CSE (stacked_linear)
            return torch.ops.medusa.stacked_linear(x, self.layers[0].weight, sum(self.sizes)).split(self.sizes, -1)[index]
        version = None if x.is_inference() else x._version  # inference tensors keep no version
        if self._input is not x or self._version != version or self._parts[index] is None:
            self._input, self._version = x, version
            self._parts = list(clock.charged("linears", self.product, x).split(self.sizes, -1))
        part, self._parts[index] = self._parts[index], None
        if all(p is None for p in self._parts):
            self._input = None
        return part

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times every sibling's weight: ``[..., sum of out_features]``."""
        if self.kind == "gemv":
            if x.dtype == self.layers[0].weight.dtype and x.device.type == "cpu":
                return gemv.product(x, self.packed, sum(self.sizes), self.bias)
        else:
            try:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            except RuntimeError:  # as packed_product: torch's kernels compute it or raise torch's error
                pass
        return torch.cat([nn.functional.linear(x, layer.weight, layer.bias) for layer in self.layers], -1)


def sibling_groups(modules: list[nn.Module], layers: list[nn.Linear]) -> list[list[nn.Linear]]:
    """Groups of ``layers`` that one module calls on the same input (``SIBLINGS`` names), with
    one input size, dtype and bias-or-not, each layer in at most one group and nowhere else."""
    packable = {id(layer) for layer in layers}
    every = list({id(m): m for module in modules for m in module.modules()}.values())
    uses: dict[int, int] = {}  # parents per layer: a layer shared elsewhere keeps its own product
    for child in every:
        for layer in child.children():
            uses[id(layer)] = uses.get(id(layer), 0) + 1
    groups, taken = [], set()
    for child in every:
        for names in SIBLINGS:
            found = [getattr(child, name, None) for name in names]
            if not all(isinstance(layer, nn.Linear) and id(layer) in packable and id(layer) not in taken
                       and uses.get(id(layer)) == 1 for layer in found):
                continue
            if len({(layer.in_features, layer.weight.dtype, layer.bias is None) for layer in found}) == 1:
                groups.append(found)
                taken.update(id(layer) for layer in found)
    return groups


class PackedLinears:
    """Inside ``with packed:``, the linear layers of ``modules`` run packed kernels: oneDNN's
    (``kernels="onednn"``), or this package's gemv kernels for float32 and bfloat16 layers with
    oneDNN for the others (``kernels="gemv"``, medusa/runtime/gemv.py).

    ``stock_above``: inputs of more rows than this run the stock ``F.linear`` (a prompt's
    prefill). In bfloat16 the packed kernels matched torch's bit for bit up to a few hundred rows
    where measured but not always above (the stock kernel changes strategy for large inputs:
    docs/performance.md#linear-kernels-per-cpu-mkl-or-onednn), so an engine that promises stock transformers' tokens
    packs only its decoding passes. ``stock_rows``: inputs of at most this many rows run the
    stock ``F.linear`` too (a split's small passes: :func:`split_kernels`). ``fuse``: layers
    called on one input (q/k/v, gate/up: :class:`_Siblings`) run as one product, in eager passes
    and compiled ones alike (``medusa::stacked_linear``); they have no packed copy of their own.
    Entering twice (nested) is allowed; the layers are restored when the outermost exits."""

    def __init__(self, *modules: nn.Module | None, stock_above: int | None = None, fuse: bool = True,
                 kernels: str = "onednn", stock_rows: int | None = None) -> None:
        if kernels not in PACKED:
            raise ValueError(f"PackedLinears runs {' or '.join(PACKED)} kernels, not {kernels!r}")
        if kernels == "gemv":
            gemv.library()  # GemvUnavailable (one line) if the kernels cannot be built here
        elif not onednn_available():
            raise RuntimeError("this torch build has no oneDNN linear kernels: use kernels='default'")
        modules = [m for m in modules if m is not None]
        layers = linear_layers(modules, kernels)
        groups = sibling_groups(modules, layers) if fuse else []
        fused = {id(layer) for group in groups for layer in group}
        with torch.no_grad():
            self._packed = [(layer, kind_of(kernels, layer.weight), None if layer.bias is None else layer.bias.detach())
                            for layer in layers if id(layer) not in fused]
            self._packed = [(layer, kind, pack_as(kind, layer.weight.detach()), bias) for layer, kind, bias in self._packed]
        owner = next(_OWNERS)
        for layer, kind, packed, _ in self._packed:
            _PACKED.setdefault(layer.weight.data_ptr(), []).append((owner, kind, packed))
        addresses = [layer.weight.data_ptr() for layer, _, _, _ in self._packed]
        # One forward per layer, made once: a compiled pass guards on each layer's forward, and a
        # new object at every entry would recompile it at every step.
        self._forwards = [(layer, functools.partial(_packed_forward, layer, bias, stock_above, stock_rows))
                          for layer, _, _, bias in self._packed]
        for group in groups:
            half = group[0].weight.dtype in (torch.bfloat16, torch.float16)
            limit = min(FUSED_ROWS, stock_above or FUSED_ROWS) if half else stock_above
            siblings = _Siblings(group, limit, kind_of(kernels, group[0].weight), stock_rows)
            self._forwards += [(layer, functools.partial(siblings.forward, i)) for i, layer in enumerate(group)]
            _STACKED.setdefault(group[0].weight.data_ptr(), []).append((owner, siblings))
            addresses.append(group[0].weight.data_ptr())
        weakref.finalize(self, _release, owner, addresses)
        self._forwards_in = [(layer.__dict__, forward) for layer, forward in self._forwards]
        self.fused = len(fused)  # layers that run as part of a stacked product
        self._depth = 0

    def __len__(self) -> int:
        return len(self._forwards)

    def __enter__(self) -> PackedLinears:
        if self._depth == 0:
            # Straight into each layer's instance dict: what nn.Module's __setattr__ and __delattr__
            # do with a plain attribute, without their checks. An engine enters and leaves the
            # scope at every step, over 200+ layers.
            for attributes, forward in self._forwards_in:
                attributes["forward"] = forward
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            for attributes, _ in self._forwards_in:
                attributes.pop("forward", None)


def _release(owner: int, addresses: list[int]) -> None:
    for registry in (_PACKED, _STACKED):
        for address in addresses:
            kept = [entry for entry in registry.get(address, ()) if entry[0] != owner]
            if kept:
                registry[address] = kept
            else:
                registry.pop(address, None)
