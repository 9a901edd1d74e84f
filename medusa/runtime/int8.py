"""Int8 drafting weights: a draft head's linear layers and vocabulary rows multiplied by int8
copies of their weights (torch's weight-only int8 kernel, one bfloat16 scale per output row).

Drafts only propose (the target verifies every token in its own dtype), so a draft head may
multiply by int8 weights: the kernel reads half the bytes of bfloat16 and, at the 1-4 rows a
drafting level has, ran faster than a bfloat16 product where measured
(docs/usage.md#loading). Used by EAGLE heads with
``draft_dtype="int8"`` (medusa/models/eagle_heads.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def int8_available(device: torch.device | str = "cpu") -> bool:
    """Whether this torch build runs ``torch._weight_int8pack_mm`` on ``device`` (CPU only)."""
    return torch.device(device).type == "cpu" and hasattr(torch, "_weight_int8pack_mm") and _probe_int8()


@functools.cache
def _probe_int8() -> bool:
    try:
        rows = Int8Rows.of(torch.eye(4, INT8_K_MULTIPLE, dtype=torch.bfloat16))
        out = rows.matmul(torch.ones(3, INT8_K_MULTIPLE, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(out.float(), torch.ones(3, 4), atol=1e-2))


# The kernel steps through K 16 values at a time with aligned vector loads (AVX-512; 8 on AVX2):
# an input width that is not a multiple of 16 reads past its rows, and an input that does not
# start on a 32-byte boundary faults, so Int8Rows takes only such widths and realigns inputs.
INT8_K_MULTIPLE = 16
_ALIGN = 64


class Int8Rows:
    """A ``[N, K]`` weight as int8 rows and one bfloat16 scale per row (symmetric, max-abs);
    ``K`` a multiple of ``INT8_K_MULTIPLE``."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.q, self.scales = q, scales

    @classmethod
    @torch.no_grad()
    def of(cls, weight: torch.Tensor) -> Int8Rows:
        if weight.shape[-1] % INT8_K_MULTIPLE:
            raise ValueError(f"int8 rows need a width that is a multiple of {INT8_K_MULTIPLE}, got {weight.shape[-1]}")
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).to(torch.bfloat16)
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        return cls(q, scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[..., K]``, in bfloat16."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if not flat.is_contiguous() or flat.data_ptr() % _ALIGN:  # a view into a larger tensor
            flat = flat.clone(memory_format=torch.contiguous_format)
        return torch._weight_int8pack_mm(flat, self.q, self.scales).reshape(*x.shape[:-1], self.q.shape[0])


def _int8_forward(rows: Int8Rows, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    out = rows.matmul(x)
    return out if bias is None else out + bias


def int8_linears(module: nn.Module) -> int:
    """Run every ``nn.Linear`` of ``module`` on int8 copies of its weights (the float weights
    stay, so ``state_dict`` is unchanged); returns how many. Not for modules an engine packs
    (:class:`PackedLinears` replaces and deletes ``forward`` too). Raises ValueError for a layer
    whose input width is not a multiple of ``INT8_K_MULTIPLE``, before changing any."""
    layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
    narrow = [m.in_features for m in layers if m.in_features % INT8_K_MULTIPLE]
    if narrow:
        raise ValueError(f"int8 weights need input widths that are multiples of {INT8_K_MULTIPLE}, got {narrow[0]}")
    for layer in layers:
        bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16)
        layer.forward = functools.partial(_int8_forward, Int8Rows.of(layer.weight), bias)
    return len(layers)
