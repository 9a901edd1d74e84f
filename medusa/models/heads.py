"""Medusa heads: extra decoding heads on the target's last hidden state.

Head ``k`` (0-based) reads the hidden state at position ``t`` and predicts the token at
``t + k + 2``: the target's own ``lm_head`` already predicts ``t + 1``. Each head is
``num_layers`` residual blocks ``x + SiLU(W x + b)`` (W zero-initialised, so a fresh head
starts as a copy of the target's next-token predictor) followed by a vocabulary projection:
either the target's frozen ``lm_head`` (``projection="shared"``, the default: checkpoints
of a few MB) or a trainable per-head copy of it (``projection="per_head"``, Medusa-1's
layout).

Checkpoints are a heads folder (:mod:`medusa.models.heads_config`); :mod:`medusa.models.loader`
loads heads of every kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from medusa.errors import MedusaError
from medusa.models.heads_config import HeadsConfig, checked_draft_vocab, save_heads
from medusa.runtime import gemv
from medusa.runtime.kernels import gemv_copy
from medusa.runtime.ngrams import NgramTable


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with W zero-initialised: starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` heads over a target's hidden states.

    In ``shared`` mode the target's ``lm_head`` is held by reference, outside the module's
    parameters: it is neither trained, saved, nor moved with the heads.
    """

    def __init__(self, config: HeadsConfig, lm_head: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        # One ModuleList per head, with a fresh ResBlock per layer (never [block] * n,
        # which would share one module n times).
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.proj: nn.ModuleList | None = None
        if config.projection == "per_head":
            self.proj = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(config.num_heads))
            if lm_head is not None:
                self.copy_projection_from(lm_head)
        self._lm_head: tuple[nn.Module, ...] = ()
        if lm_head is not None:
            self.bind(lm_head)
        # Greedy drafting only needs each head's top-k, so it may score a subset of the
        # vocabulary (see set_draft_vocab); None scores all of it.
        self.draft_vocab: torch.Tensor | None = None
        self._draft_weight: torch.Tensor | None = None
        self._draft_gemv: tuple[torch.Tensor, torch.Tensor] | None = None  # those rows packed for the gemv kernels
        # Calibrated trees by device type ("cpu", "cuda"), from calibration.json.
        self.trees: dict[str, list[tuple[int, ...]]] = {}
        # The folder's n-gram table of the target's answers (mode hybrid's chain where the text has no match).
        self.ngrams: NgramTable | None = None

    # -- wiring -------------------------------------------------------------------------
    def describe(self) -> str:
        """What these heads are, in a few words (the chat's banner)."""
        return f"{self.config.num_heads} heads x {self.config.num_layers} layer(s)"

    def forget_calibration(self) -> None:
        """Drop the trees calibrated for other weights (after training: recalibrate)."""
        self.trees = {}

    def bind(self, lm_head: nn.Module) -> MedusaHeads:
        """Attach the target's vocabulary projection (used by ``shared`` heads)."""
        weight = lm_head.weight
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise MedusaError(
                f"heads expect a target with vocab {self.config.vocab_size} x hidden {self.config.hidden_size}, "
                f"but its lm_head is {tuple(weight.shape)[0]} x {tuple(weight.shape)[1]}: use heads trained for this model"
            )
        self._lm_head = (lm_head,)
        return self

    def copy_projection_from(self, lm_head: nn.Module) -> None:
        assert self.proj is not None
        with torch.no_grad():
            for p in self.proj:
                p.weight.copy_(lm_head.weight)

    def set_draft_vocab(self, ids: torch.Tensor | list[int] | None) -> None:
        """Restrict :meth:`topk` to these token ids (e.g. the few thousand tokens that
        cover almost all of the target's output). Projecting onto a subset is several
        times cheaper than the full vocabulary; verification stays exact whatever the
        subset, only the odd rare-token candidate is lost. ``forward`` is unaffected."""
        device = self.projection_weight(0).device if self.proj is not None or self._lm_head else None
        self.draft_vocab, self._draft_weight = checked_draft_vocab(ids, self.config.vocab_size, device), None

    def _draft_weights(self) -> torch.Tensor:
        """``[1 or K, S, H]`` projection rows of the draft vocabulary in the heads' own dtype (a
        bfloat16 copy of a float32 ``lm_head``'s rows when the heads draft in bfloat16), built
        once per device/dtype."""
        w0 = self.projection_weight(0)
        dtype = self.dtype
        stale = self._draft_weight is None or self._draft_weight.device != w0.device or self._draft_weight.dtype != dtype
        if stale:
            ids = self.draft_vocab.to(w0.device)
            self.draft_vocab = ids
            n = 1 if self.proj is None else self.num_heads
            self._draft_weight = torch.stack([self.projection_weight(k)[ids] for k in range(n)]).to(dtype).contiguous()
        return self._draft_weight

    @property
    def dtype(self) -> torch.dtype:
        """The heads' own dtype (their blocks'), which may differ from the target's: drafting
        only proposes, so heads may run in bfloat16 beside a float32 target (``medusa.load``
        picks by measurement, medusa/autotune/device.py)."""
        param = next(self.blocks.parameters(), None)
        return param.dtype if param is not None else self.projection_weight(0).dtype

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def projection_weight(self, k: int) -> torch.Tensor:
        """The ``[V, H]`` vocabulary projection of head ``k``."""
        if self.proj is not None:
            return self.proj[k].weight
        if not self._lm_head:
            raise MedusaError("shared-projection heads are not bound to a target: call heads.bind(model.lm_head)")
        return self._lm_head[0].weight

    # -- compute ------------------------------------------------------------------------
    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [K, ..., H]``: each head's residual-block output."""
        hidden = hidden.to(self.dtype)
        return torch.stack([blocks(hidden) for blocks in self.blocks])

    def logits(self, hidden: torch.Tensor, heads: Sequence[int] | None = None,
               vocab: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., H] -> [n, ..., V]`` logits of the listed ``heads`` (default: all), in the
        projection's dtype; ``[n, ..., S]`` over the token ids ``vocab`` ``[S]`` when given
        (the draft vocabulary's rows are cached, any other subset is gathered per call).
        Every caller (drafting, training losses, calibration) computes head logits here."""
        idx = list(range(self.num_heads)) if heads is None else list(heads)
        hidden = hidden.to(self.dtype)  # a float32 target's states into bfloat16 heads
        feats = torch.stack([self.blocks[i](hidden) for i in idx])  # [n, ..., H]
        if vocab is not None:
            if vocab is self.draft_vocab:
                rows = self._draft_weights()  # [1 or K, S, H]
                packed = self._gemv_rows(rows)
                if packed is not None:  # every head's rows (every input's) in one product, each row on its own
                    flat = gemv.product(feats.reshape(-1, feats.shape[-1]), packed, rows.shape[1])
                    return flat.reshape(*feats.shape[:-1], rows.shape[1])
                weights = [rows[0 if self.proj is None else i] for i in idx]
            else:
                weights = [self.projection_weight(0 if self.proj is None else i)[vocab] for i in idx]  # n x [S, H]
            return torch.stack([f.to(w.dtype) @ w.T for f, w in zip(feats, weights)])
        if self.proj is not None:
            return torch.stack([self.proj[i](f) for i, f in zip(idx, feats)])
        # The shared projection is the target's (maybe bf16) lm_head: cast the small side. It
        # is called as a module so that sharded (ZeRO-3) weights are gathered for it.
        dtype = self.projection_weight(0).dtype  # raises the one-line error for unbound heads
        return self._lm_head[0](feats.to(dtype))

    def _gemv_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The shared projection's draft rows packed for the gemv kernels where the target's
        product runs them now (the engine's kernel scope on a CPU), else None. On those kernels each
        row of a product is computed on its own, the same bits whatever other rows it is with, so
        several sequences' heads score in one product (medusa/decoding/proposers/shared.py)."""
        if self.proj is not None or not self._lm_head or rows.device.type != "cpu" or torch.is_grad_enabled():
            return None  # (the kernels have no backward: a product that trains stays torch's)
        if gemv_copy(self._lm_head[0], 1) is None:
            return None
        if self._draft_gemv is None or self._draft_gemv[0] is not rows:
            self._draft_gemv = (rows, gemv.pack(rows[0]))
        return self._draft_gemv[1]

    def shares_rows(self) -> bool:
        """Whether :meth:`topk_many` gives each input the bits it gets alone (its draft scores run
        on the gemv kernels now: :meth:`_gemv_rows`)."""
        return self.draft_vocab is not None and self._gemv_rows(self._draft_weights()) is not None

    def topk_many(self, hidden: torch.Tensor, k: int, num_heads: int) -> torch.Tensor:
        """``[B, H] -> [B, num_heads, k]``: :meth:`topk` of each row, in one call."""
        return self.topk(hidden, k, num_heads=num_heads).transpose(0, 1)  # (topk takes [..., H])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [K, ..., V]`` logits of every head."""
        return self.logits(hidden)

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int | list[int], num_heads: int | None = None) -> torch.Tensor:
        """``[H] -> [K, max(k)]`` (``[..., H] -> [K, ..., max(k)]``) ids of each head's most likely tokens, best first.

        ``k`` may be a list giving how many candidates each head needs (a tree rarely
        needs as many from deep heads as from the first); ``num_heads`` limits how many
        heads are evaluated at all.
        """
        kmax = max(k) if isinstance(k, list) else k
        logits = self.logits(hidden, range(num_heads or self.num_heads), self.draft_vocab)  # [n, V or S]
        top = logits.topk(kmax, dim=-1).indices
        return top if self.draft_vocab is None else self.draft_vocab[top]

    # -- persistence --------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` atomically (temp folder, then rename)."""
        return save_heads(self, folder)
