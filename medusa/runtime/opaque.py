"""Opaque ops for compiled exact passes (CPU): the two places outside attention and the linear
layers where inductor rounds otherwise than eager - an RMSNorm's mean of squares and the rotary
embedding's cos and sin - run as custom ops by eager's kernels inside a compiled graph
(docs/compile.md#compiled-exact-passes). Attention itself is ``medusa::exact_attention``
(:mod:`medusa.runtime.exact`)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from medusa.errors import MedusaError


# A compiled exact pass (docs/compile.md#compiled-exact-passes): inductor, with its emulated
# precision casts, rounds every fused elementwise op as eager does, but its own reductions
# sum in another order. An RMSNorm's mean of squares is the one reduction of a decoder layer
# outside the linear layers and attention, so it too runs as an opaque op, by eager's kernel.
@torch.library.custom_op("medusa::mean_square", mutates_args=())
def mean_square(x: torch.Tensor) -> torch.Tensor:
    """``x.pow(2).mean(-1, keepdim=True)``, by eager's kernels inside a compiled pass too."""
    return x.pow(2).mean(-1, keepdim=True)


@mean_square.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], 1)


class OpaqueRMSNorm(torch.nn.Module):
    """A Llama-style RMSNorm (Llama, Qwen2/3, Mistral: ``variance_epsilon``), same weight, same
    arithmetic, with its mean of squares an opaque op inside a compiled pass."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.replaced = type(norm).__name__

    def forward(self, hidden_states: torch.Tensor, opaque: bool | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        opaque = torch.compiler.is_compiling() if opaque is None else opaque  # opaque: force either way
        square = torch.ops.medusa.mean_square(h) if opaque else h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(square + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, replaces {self.replaced}"


@torch.library.custom_op("medusa::rope", mutates_args=())
def rope(inv_freq: torch.Tensor, position_ids: torch.Tensor, scaling: float, like: torch.Tensor,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary embedding's ``(cos, sin)`` in ``like``'s dtype, by eager's kernels inside a
    compiled pass too (inductor's cos and sin rounded otherwise at a few positions)."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=like.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(like.dtype), (emb.sin() * scaling).to(like.dtype)


@rope.register_fake
def _(inv_freq, position_ids, scaling, like):
    shape = (*position_ids.shape, 2 * inv_freq.shape[-1])
    return like.new_empty(shape), like.new_empty(shape)


class OpaqueRotary(torch.nn.Module):
    """A rotary embedding of fixed frequencies (not ``dynamic`` or ``longrope``) whose
    ``(cos, sin)`` are one opaque op inside a compiled pass; eager, the module it wraps."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, opaque: bool | None = None):
        if torch.compiler.is_compiling() if opaque is None else opaque:
            return torch.ops.medusa.rope(self.rotary.inv_freq, position_ids, float(self.rotary.attention_scaling), x)
        return self.rotary(x, position_ids)


def opaque_ops(model: PreTrainedModel) -> int:
    """Make a compiled pass of ``model`` round as eager does where inductor's own code does not:
    each RMSNorm becomes an :class:`OpaqueRMSNorm` sharing its weight and each rotary embedding
    an :class:`OpaqueRotary`, each checked on random input to be bit-identical to the module it
    replaces in eager. Returns how many modules are replaced (again: counted, not replaced twice).
    Raises MedusaError for another form (Gemma's ``1 + weight`` norm, a dynamic rotary), whose
    compiled pass this package cannot make exact yet."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, (OpaqueRMSNorm, OpaqueRotary)):
            count += 1
            continue
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            replacement = _opaque_norm(module)
        elif kind.endswith("RotaryEmbedding") and not isinstance(model.get_submodule(name.rpartition(".")[0]), OpaqueRotary):
            replacement = _opaque_rotary(module)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, replacement)
        count += 1
    return count


def _unsupported(module: torch.nn.Module) -> MedusaError:
    return MedusaError(f"compiled exact passes need Llama-style RMSNorms and fixed rotary embeddings; "
                       f"{type(module).__name__} is another form: load the target in float32 (dtype='float32') "
                       "or drop compile")


def _opaque_norm(norm: torch.nn.Module) -> OpaqueRMSNorm:
    weight = getattr(norm, "weight", None)
    if weight is None or not hasattr(norm, "variance_epsilon"):
        raise _unsupported(norm)
    opaque = OpaqueRMSNorm(norm)
    x = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    if not torch.equal(norm(x), opaque(x, opaque=True)):
        raise _unsupported(norm)
    return opaque


def _opaque_rotary(rotary: torch.nn.Module) -> OpaqueRotary:
    kinds = getattr(rotary, "rope_type", "default")
    if (not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor) or not hasattr(rotary, "attention_scaling")
            or not isinstance(kinds, str) or kinds in ("dynamic", "longrope")):
        raise _unsupported(rotary)
    opaque = OpaqueRotary(rotary)
    x = torch.zeros(1, device=rotary.inv_freq.device)  # only its dtype and device are read
    positions = torch.arange(4096, device=rotary.inv_freq.device)[None]
    for dtype in (torch.float32, torch.bfloat16):
        got, want = opaque(x.to(dtype), positions, opaque=True), rotary(x.to(dtype), positions)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise _unsupported(rotary)
    return opaque
