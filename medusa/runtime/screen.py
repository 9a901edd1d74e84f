"""A vocabulary screen: a greedy row's argmax without reading the whole float32 ``lm_head``.

The vocabulary projection of a decoding pass reads the whole output weight for every pass
(SmolLM2-135M: 49,152 x 576 float32, 113 MB, a quarter of a one-row pass's bytes). A greedy
request without penalties or log-probabilities reads nothing of a verified row's logits but
their argmax, so for such rows (:attr:`Proposal.argmax <medusa.decoding.state.Proposal>`) the
projection is screened:

1. ``s``: the product with a bfloat16 copy of the weight (half the bytes), in float32;
2. ``e_j = c * ||w_j|| * ||x||`` bounds ``|y_j - s_j|``, where ``y`` is the float32 product the
   gemv kernel computes: rounding a weight to bfloat16 moves it by at most 2^-8 of itself, and
   either product's float32 sums (chunks of 64, then the chunks) by at most
   ``(64 + K / 64) * 2^-24`` of ``sum |w_j,k x_k|`` (<= ``||w_j|| ||x||``);
3. the candidates: every ``j`` with ``s_j + e_j >= max_k (s_k - e_k)``. Any other ``j`` has
   ``y_j <= s_j + e_j < s_k - e_k <= y_k`` for the ``k`` attaining that maximum, so every
   output equal to the row's largest ``y`` is a candidate;
4. the candidates' float32 outputs, by the same kernel code: the very bits the whole product
   gives them (:func:`medusa.runtime.gemv.pick`);
5. the row's logits: those values, ``-inf`` elsewhere. Its argmax, first of ties, is the whole
   product's.

On the embedded model a row keeps one to a few candidates. It applies where the lm_head runs
the gemv kernel in float32 and its logits are the plain product (no bias, scale or softcap:
:func:`medusa.runtime.hf.lm_logits`); ``MEDUSA_VOCAB_SCREEN=0`` turns it off. Measured in
docs/performance.md#the-vocabulary-screen.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa.runtime import clock, gemv, kernels
from medusa.runtime import hf as kv

CHUNK = 64  # gemv.c's KC: the products are summed in chunks of this many, then the chunk sums
BF16_ROUNDING = 2.0**-8  # a float32 rounded to bfloat16 (8 significant bits) moves by at most this much of itself
FLOAT_ROUNDING = 2.0**-24
# Rows a pass screens at most: the bfloat16 product's arithmetic grows with the rows, and from
# about 8 rows it costs what the float32 one does (docs/performance.md#the-vocabulary-screen)
MAX_ROWS = 4
# with the CPU's bfloat16 dot products (x in bfloat16 too: twice the products an instruction) up to
DOT_MAX_ROWS = 16
TINY = 1e-30  # added to every bound: products and sums the dot products flush to zero below ~1e-38
CANDIDATES = 64  # a row's candidates at most (one to a few where measured): more, and the whole product


def bound_factor(in_features: int, dot: bool = False) -> float:
    """``c`` of the module docstring for products over ``in_features`` inputs, with a margin for
    the norms' own rounding. ``dot``: the screen's ``x`` is rounded to bfloat16 too, and its sums
    run left to right over every input (the CPU's dot products)."""
    exact_sums = (CHUNK + -(-in_features // CHUNK) + 2) * FLOAT_ROUNDING
    if dot:
        rounding = 2 * BF16_ROUNDING + BF16_ROUNDING**2
        return (rounding + (exact_sums + (in_features + 2) * FLOAT_ROUNDING) * (1 + 2 * rounding)) * 1.001
    return (BF16_ROUNDING + 2 * exact_sums * (1 + BF16_ROUNDING)) * 1.001


class VocabScreen:
    """The screen of one model's ``lm_head`` (see the module docstring): :meth:`logits`."""

    def __init__(self, head: nn.Linear, dot: bool | None = None) -> None:
        """``dot``: screen with the CPU's bfloat16 dot products (None: where the kernels have them)."""
        weight = head.weight.detach()
        self.head, self.vocab, self.features = head, weight.shape[0], weight.shape[1]
        self.dot = gemv.dot_available() if dot is None else dot
        self.half = gemv.pack_dot(weight) if self.dot else gemv.pack(weight.to(torch.bfloat16))
        self.max_rows = DOT_MAX_ROWS if self.dot else MAX_ROWS
        self.norms = weight.norm(dim=1) * bound_factor(self.features, self.dot)  # [V]: e_j = norms_j ||x|| + TINY

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The screen's ``[R, V]`` product of float32 rows ``x``."""
        if self.dot:
            return gemv.dot_product(x, self.half, self.vocab)
        return gemv.product(x, self.half, self.vocab)

    def logits(self, model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_logits(model, hidden)`` ``[R, V]`` for rows whose argmax alone is read: the
        screened candidates' float32 values, ``-inf`` elsewhere. The whole product where the
        lm_head's product of these rows does not run the gemv kernel now, for more than :attr:`max_rows` rows, or where a
        row is not finite or too close to call within :data:`CANDIDATES` candidates."""
        copy = kernels.gemv_copy(self.head, hidden.shape[0]) if hidden.shape[0] <= self.max_rows else None
        if copy is None:
            return kv.lm_logits(model, hidden).float()
        x = hidden.to(torch.float32).contiguous()
        screened = clock.charged("linears", self.product, x)  # [R, V]
        found = gemv.screen(screened, self.norms, x.norm(dim=1), TINY, CANDIDATES * x.shape[0])
        if found is None:
            return kv.lm_logits(model, hidden).float()
        rows, cols = found
        logits = screened.fill_(float("-inf"))
        logits[rows, cols] = clock.charged("linears", gemv.pick, x, copy, rows, cols)
        return logits


def for_model(model: PreTrainedModel, kernel_name: str) -> VocabScreen | None:
    """The screen for ``model`` under the engine's kernels, or None where it does not apply:
    kernels other than gemv, an lm_head that is not a float32 CPU linear without bias, logits
    scaled or capped after it, or ``MEDUSA_VOCAB_SCREEN=0``. A pass screens only where its
    lm_head product runs the gemv kernel (not a split's small passes: :func:`~medusa.runtime.kernels.gemv_copy`)."""
    if os.environ.get("MEDUSA_VOCAB_SCREEN", "1") == "0" or not kernel_name.startswith("gemv"):
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    weight = head.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not gemv.available():
        return None
    top, text = model.config, kv.text_config(model)
    for name in ("logit_scale", "logits_scaling", "final_logit_softcapping"):
        if getattr(top, name, None) or getattr(text, name, None):
            return None
    return VocabScreen(head)
