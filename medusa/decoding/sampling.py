"""Sampling controls: one config, the target's processed distribution ``p``, and draws from it.

:class:`SamplingConfig` is the single source of defaults for the engine, ``infer.bench`` and
``infer.chat``. :func:`probabilities` turns logits into ``p`` exactly as transformers'
sampling does (temperature, then top-k, then top-p, the order of its logits warpers), so a
speculative step and ``model.generate(do_sample=True, ...)`` sample the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from medusa.errors import MedusaError

ACCEPTANCE = ("lossless", "typical")


# temperatures below this sample as greedy (the distribution is one-hot to float32 precision long
# before; dividing logits by 1e-40 gives inf and NaN probabilities)
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen.

    ``temperature`` 0 is greedy decoding (``top_p``, ``top_k``, ``seed`` are then unused).
    ``top_k`` 0 and ``top_p`` 1 switch those filters off (transformers' ``generate`` would
    apply top-k 50 when it is left unset; here nothing is applied unless asked for).
    ``seed`` makes sampling reproducible: the same seed, prompt, mode and tree give the same
    tokens; ``None`` draws a fresh seed per generation.

    ``acceptance`` picks the verification rule when ``temperature > 0``:

    * ``"lossless"`` (default): speculative sampling, the output distribution equals the
      target's exactly whatever the heads propose;
    * ``"typical"``: Medusa's typical acceptance, lossy: a candidate is accepted when
      ``p(candidate) > min(typical_epsilon, typical_delta * exp(-H(p)))``; it accepts more
      tokens per step but the output no longer follows the target's distribution. At
      temperature 0 it reduces to greedy. The defaults are Medusa's (threshold 0.09,
      alpha 0.3).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    acceptance: str = "lossless"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise MedusaError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < GREEDY_BELOW:  # logits / 1e-40 overflow to inf: such a temperature is greedy
            object.__setattr__(self, "temperature", 0.0)
        if self.seed is not None and (isinstance(self.seed, bool) or int(self.seed) != self.seed
                                      or not SEED_RANGE[0] <= int(self.seed) <= SEED_RANGE[1]):
            raise MedusaError(f"seed must be a whole number in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (torch's 64-bit "
                              f"generator seed), got {self.seed!r}")
        if not 0 < self.top_p <= 1:
            raise MedusaError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise MedusaError(f"top_k must be a whole number >= 0 (0 = off), got {self.top_k}")
        if self.acceptance not in ACCEPTANCE:
            raise MedusaError(f"unknown acceptance {self.acceptance!r}: use one of {', '.join(ACCEPTANCE)}")
        if not 0 < self.typical_epsilon <= 1 or not self.typical_delta > 0:
            raise MedusaError(
                f"typical acceptance needs 0 < typical_epsilon <= 1 and typical_delta > 0, "
                f"got {self.typical_epsilon} and {self.typical_delta}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def override(self, **values: Any) -> SamplingConfig:
        """A copy with the given fields replaced; ``None`` values mean "keep mine"."""
        names = {f.name for f in fields(self)}
        unknown = set(values) - names
        if unknown:
            raise MedusaError(f"unknown sampling option {sorted(unknown)[0]!r}: use one of {', '.join(sorted(names))}")
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def generator(self, device: torch.device | str) -> torch.Generator:
        """A generator on ``device`` seeded with ``seed`` (a fresh random seed when ``None``)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen

    def hf_generate_kwargs(self) -> dict[str, Any]:
        """The ``model.generate`` arguments that sample the same distribution with transformers.

        Every control is passed explicitly so a model's ``generation_config`` (or
        transformers' own top-k 50 default) cannot change the distribution.
        """
        if self.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": float(self.temperature), "top_p": float(self.top_p),
                "top_k": int(self.top_k)}


def probabilities(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``[..., V]`` logits -> ``[..., V]`` float32 ``p``: the distribution the target samples from.

    Temperature, then top-k (ties with the k-th logit are kept), then top-p (the smallest
    tokens are dropped while their total mass stays <= 1 - top_p, at least one token kept):
    the semantics and order of transformers' ``TemperatureLogitsWarper``,
    ``TopKLogitsWarper`` and ``TopPLogitsWarper``. At temperature 0, ``p`` is the one-hot
    of the argmax, so every rule built on ``p`` reduces to greedy decoding.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = logits / sampling.temperature
    vocab = scores.shape[-1]
    k = min(int(sampling.top_k), vocab)
    if 0 < k < vocab:
        kept = scores.topk(k, dim=-1).values  # [..., k] descending
        scores = scores.masked_fill(scores < kept[..., -1:], float("-inf"))
    if sampling.top_p < 1:
        # Only the best tokens can be kept: top-k's survivors, or enough of the best to hold
        # the nucleus. Every token left out of ``ranked`` is dropped by the rule below.
        ranked = kept if 0 < k < vocab else _nucleus_logits(scores, sampling.top_p)  # [..., r] descending
        mass = (ranked - scores.logsumexp(dim=-1, keepdim=True)).exp()  # [..., r] their probabilities
        # transformers' rule: drop the smallest tokens while their total mass (tokens left
        # out of ``ranked`` included) stays <= 1 - top_p; the most likely token always stays.
        outside = (1 - mass.sum(dim=-1, keepdim=True)).clamp(min=0)
        drop = outside + mass.flip(-1).cumsum(dim=-1) <= 1 - sampling.top_p  # ascending order
        drop[..., -1] = False
        # Dropped tokens are a prefix of the ascending order: the first kept logit is the cut.
        first_kept = (~drop).long().argmax(dim=-1, keepdim=True)  # [..., 1]
        cut = ranked.flip(-1).gather(-1, first_kept)
        scores = scores.masked_fill(scores < cut, float("-inf"))
    return scores.softmax(dim=-1)


def _nucleus_logits(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[..., r]`` the ``r`` best logits of every row, descending, for an ``r`` whose tokens
    hold at least ``top_p`` of every row's mass (so the whole nucleus is among them)."""
    vocab = scores.shape[-1]
    if scores.device.type == "cpu":
        # Sorting a tree's [N, V] logits costs more than the forward pass on a CPU, while
        # the nucleus is usually a few dozen tokens: grow a top-r until it holds top_p
        # (reading the check back is free on a CPU; accelerators sort fast, and skip this).
        lse = scores.logsumexp(dim=-1, keepdim=True)
        r = 64
        while r < vocab:
            top = scores.topk(r, dim=-1).values
            if bool(((top - lse).exp().sum(dim=-1) >= top_p).all()):
                return top
            r *= 4
    return scores.sort(dim=-1, descending=True).values


def _cdf_dtype(device: torch.device) -> torch.dtype:
    # float64 cumulative sums keep every token's interval width exact to ~1e-16 over a 150k
    # vocabulary (float32 would skew tail tokens by ~1e-3 in total); MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from each row of ``probs`` ``[..., V]`` (unnormalised is fine) -> ``[...]`` ids.

    Inverse-CDF sampling: one uniform per row and a search in the cumulative sums, much
    cheaper on a CPU than a race of ``V`` exponentials, and with no host sync. A token of
    probability 0 is never drawn: its interval is empty.
    """
    dtype = _cdf_dtype(probs.device)
    cdf = probs.to(dtype).cumsum(dim=-1)  # [..., V]
    total = cdf[..., -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=dtype) * total
    # u < total must hold strictly, or the search would run past the last token.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The target's next token after ``logits`` ``[..., V]``: argmax when greedy, else a draw from ``p``."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample(probabilities(logits, sampling), generator)
