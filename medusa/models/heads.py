"""Medusa heads: extra decoding heads on the target's last hidden state.

Head ``k`` (0-based) reads the hidden state at position ``t`` and predicts the token at
``t + k + 2``: the target's own ``lm_head`` already predicts ``t + 1``. Each head is
``num_layers`` residual blocks ``x + SiLU(W x + b)`` (W zero-initialised, so a fresh head
starts as a copy of the target's next-token predictor) followed by a vocabulary projection:
either the target's frozen ``lm_head`` (``projection="shared"``, the default: checkpoints
of a few MB) or a trainable per-head copy of it (``projection="per_head"``, Medusa-1's
layout).

Checkpoints are a folder with ``config.json`` and ``model.safetensors``; nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from medusa.decoding.ngrams import NGRAMS_NAME, NgramTable
from medusa.errors import MedusaError
from medusa.models.checkpoint import atomic_folder
from medusa.models.target import DEFAULT_MODEL_ID, DEFAULT_MODEL_NAME

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Written by scripts/calibrate_tree.py: per-device trees and the draft vocabulary.
CALIBRATION_NAME = "calibration.json"
MODEL_TYPE = "medusa_heads"
PROJECTIONS = ("shared", "per_head")
# "medusa": independent heads, one per future token (this module); "eagle": one
# autoregressive decoder layer over the target's features (medusa.models.eagle).
KINDS = ("medusa", "eagle")
# How an eagle head's decoder layer sits between fusion and vocabulary (medusa.models.eagle):
# "norms" (the layer's own input norm, then the target's final norm: folders written before
# layouts existed) or "eagle1" (neither: vLLM's EAGLE-1 Llama drafter, so it exports to vLLM).
EAGLE_LAYOUTS = ("norms", "eagle1")


@dataclass
class HeadsConfig:
    """Everything needed to rebuild the heads and check they fit a target."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    projection: str = "shared"
    base_model: str | None = None
    kind: str = "medusa"  # folders written before kinds existed are Medusa heads
    eagle_layout: str = "norms"  # eagle heads only; folders written before layouts existed are "norms"
    # Free-form provenance: training arguments, per-head eval accuracy, LoRA target, ...
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MedusaError(f"unknown heads kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.eagle_layout not in EAGLE_LAYOUTS:
            raise MedusaError(f"unknown eagle layout {self.eagle_layout!r}: use one of {', '.join(EAGLE_LAYOUTS)}")
        if self.projection not in PROJECTIONS:
            raise MedusaError(f"unknown head projection {self.projection!r}: use one of {', '.join(PROJECTIONS)}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise MedusaError(f"heads need num_heads >= 1 and num_layers >= 0, got {self.num_heads} and {self.num_layers}")

    def to_dict(self) -> dict[str, Any]:
        data = {"model_type": MODEL_TYPE, **asdict(self)}
        if self.kind != "eagle":
            del data["eagle_layout"]  # Medusa folders stay as they were
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadsConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


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



def checked_draft_vocab(ids: torch.Tensor | list[int] | None, vocab_size: int,
                        device: torch.device | None = None) -> torch.Tensor | None:
    """A draft vocabulary as sorted unique ids, checked against ``vocab_size`` (None: none), on
    ``device`` (the projection's, so that it indexes that projection's top-k where it lives)."""
    if ids is None:
        return None
    ids = torch.as_tensor(ids, dtype=torch.long).unique()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise MedusaError(f"draft vocabulary ids must lie in [0, {vocab_size}): regenerate it for this model")
    return ids if device is None else ids.to(device)

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
        # Calibrated trees by device type ("cpu", "cuda"), from calibration.json.
        self.trees: dict[str, list[tuple[int, ...]]] = {}
        # The folder's n-gram table of the target's answers (mode hybrid's chain where the text has no match).
        self.ngrams: NgramTable | None = None

    # -- wiring -------------------------------------------------------------------------
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
        picks by measurement, medusa/decoding/device.py)."""
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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [K, ..., V]`` logits of every head."""
        return self.logits(hidden)

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int | list[int], num_heads: int | None = None) -> torch.Tensor:
        """``[H] -> [K, max(k)]`` ids of each head's most likely tokens, best first.

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


def base_model_name(model: nn.Module) -> str | None:
    """The name heads record as their base: the model's ``name_or_path``, with the embedded
    default's cache folder replaced by its Hub id (a path on one machine means nothing on another)."""
    base = getattr(model.config, "name_or_path", None)
    if base and Path(base).name == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_ID
    return base or None


def init_heads_for(model: nn.Module, num_heads: int = 4, num_layers: int = 1, projection: str = "shared") -> MedusaHeads:
    """Fresh heads sized for ``model`` (a Hugging Face causal LM)."""
    lm_head = model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers,
                         projection=projection, base_model=base_model_name(model))
    heads = MedusaHeads(config, lm_head=lm_head)
    return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)


def save_heads(heads: MedusaHeads, folder: str | Path) -> Path:
    """Weights + config into ``folder``, atomically; other files it had (model card, eval
    records) are kept."""
    with atomic_folder(folder, keep_other_files=True) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(heads.config.to_dict(), indent=2) + "\n")
    return Path(folder)


def read_heads_config(folder: str | Path) -> HeadsConfig:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise MedusaError(f"{folder} is not a heads folder (no {CONFIG_NAME}): pass a folder written by train/train_heads.py")
    data = json.loads(path.read_text())
    if data.get("model_type") != MODEL_TYPE:
        raise MedusaError(f"{path} is not a medusa heads config (model_type={data.get('model_type')!r})")
    return HeadsConfig.from_dict(data)


def load_heads(folder: str | Path, model: nn.Module | None = None, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """Load heads of either kind from a folder and, when ``model`` is given, check and bind them to it."""
    folder = Path(folder)
    config = read_heads_config(folder)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise MedusaError(f"{folder} has no {WEIGHTS_NAME}: pass a complete heads folder")
    return apply_calibration(heads_from_state(config, load_file(weights), model, device, dtype, where=weights), folder)


def heads_from_state(config: HeadsConfig, state: dict[str, torch.Tensor], model: nn.Module | None = None,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                     where: str | Path = "the heads") -> nn.Module:
    """Heads of ``config.kind`` from a state dict, checked (names and shapes, one-line errors)
    and, when ``model`` is given, bound to it: the one place every loader builds heads."""
    lm_head = model.get_output_embeddings() if model is not None else None
    if lm_head is not None:
        vocab, hidden = lm_head.weight.shape
        if (hidden, vocab) != (config.hidden_size, config.vocab_size):
            raise MedusaError(
                f"heads in {where} were made for hidden size {config.hidden_size} and vocab {config.vocab_size} "
                f"({config.base_model or 'unknown base'}), but the target has hidden size {hidden} and vocab {vocab}: "
                "use heads trained for this model"
            )
    if config.kind == "eagle":
        if model is None:
            raise MedusaError(f"{where} holds eagle heads, which are built on their target: pass the target model")
        from medusa.models.eagle import EagleHeads

        heads: nn.Module = EagleHeads(config, model)
        check_state(config, heads.state_dict(), state, where)
    else:
        with torch.device("meta"):  # shapes only: no memory for per-head [V, H] projections
            check_state(config, MedusaHeads(config).state_dict(), state, where)
        heads = MedusaHeads(config)
    if lm_head is not None:
        if config.kind == "medusa":
            heads.bind(lm_head)
        device = device or lm_head.weight.device
        dtype = dtype or lm_head.weight.dtype
    heads.load_state_dict(state, strict=True)
    return heads.to(device=device, dtype=dtype)


def check_state(config: HeadsConfig, expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                where: str | Path) -> None:
    """Raise unless ``state`` has exactly the tensors (names and shapes) of ``expected``."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise MedusaError(f"{where} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    wrong = [k for k, v in expected.items() if tuple(state[k].shape) != tuple(v.shape)]
    if wrong:
        k = wrong[0]
        raise MedusaError(f"{where}: {k} has shape {tuple(state[k].shape)}, its {config.kind} config implies "
                          f"{tuple(expected[k].shape)}")


def apply_calibration(heads: nn.Module, folder: str | Path) -> nn.Module:
    """Take the calibrated trees, draft vocabulary and n-gram table of a heads folder, if it has them."""
    table = Path(folder) / NGRAMS_NAME
    heads.ngrams = NgramTable.load(table, heads.config.vocab_size) if table.is_file() else None
    calibration = Path(folder) / CALIBRATION_NAME
    if calibration.is_file():
        record = json.loads(calibration.read_text())
        if hasattr(heads, "trees"):
            heads.trees = {dev: [tuple(p) for p in paths] for dev, paths in record.get("trees", {}).items()}
        if hasattr(heads, "dynamic"):
            heads.dynamic = {dev: dict(size) for dev, size in record.get("dynamic", {}).items()}
            heads.measured = {dev: entry for dev, entry in record.get("measured", {}).items() if isinstance(entry, dict)}
        if record.get("draft_vocab"):
            heads.set_draft_vocab(record["draft_vocab"])
    return heads
