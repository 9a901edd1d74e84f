"""On-disk cache of the frozen target's outputs, so epochs over it never rerun the target.

Medusa-1 trains only the heads, and a head at position ``t`` needs nothing from the target
but its final hidden state at ``t`` and (for self-distillation) its distribution at
``t + k + 1``. One pass of the target over the tokenised data stores, per token:

* ``hidden``  ``[N, H]`` float16: the final (normed) hidden state, the heads' input; for
  EAGLE-3 heads (``layers`` given) instead ``[N, L*H]``: the residual stream entering each of
  the ``L`` fused layers, stored as bfloat16 bits (``uint16``) because a middle layer's stream
  can pass float16's range (Gemma 3's reaches ~1e5);
* ``teacher_ids`` / ``teacher_logp`` ``[N, k]``: the target's top-k next tokens and their
  log-probabilities;
* ``tokens`` ``[N]``, ``loss_mask`` ``[N]`` and ``offsets`` ``[S + 1]`` (sequence bounds).

Files are ``.npy`` (read memory-mapped, nothing pickled). ``meta.json`` is written last and
carries a fingerprint of model and token ids: a cache for other data is rebuilt, never reused
as a whole. A rebuild copies the rows of every sequence an earlier cache of the same weights
already holds (matched by a digest of its token ids and loss mask, in either split), so adding
a data file runs the target over the new sequences only. Several processes build one cache
together, each writing its own sequences.

Building (and opening both splits) is :mod:`medusa.training.feature_build`. Faults: the free disk space is checked and the arrays reserved before they are allocated (a
sparse memory map the disk cannot hold ends a process with a bare "Bus error"); a build cut off
resumes from the sequences it recorded as written; one run at a time builds in a ``cache_dir``
(a lock file: a second run waits, says so, then reads what the first one built).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from medusa.errors import MedusaError
from medusa.runtime import gemv
from medusa.runtime.files import drop_cache_entry
from medusa.runtime.hf import lm_logits
from medusa.runtime.kernels import KERNELS, PackedLinears, onednn_available
from medusa.training.data import Example
from medusa.training.losses import HeadTargets

META = "meta.json"
BUILDING = "building.json"  # written once a build's arrays exist: a build cut off resumes from them
PROGRESS = "done-rank"  # + the rank: the sequences that rank has written, one index a line
LOCK = ".build.lock"  # in cache_dir: one run builds or reads the caches there at a time
FEATURES = ("hidden", "teacher_ids", "teacher_logp")
PREVIOUS = ".previous"  # an outdated cache set aside while its successor copies from it



def weights_identity(model: nn.Module) -> str:
    """A short hash of the model's weights: names, shapes, dtypes and a strided sample of
    ~4k values of every tensor. Retraining or re-saving other weights under the same name
    changes it; it costs one pass over a few thousand values per tensor, not the whole model."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy()
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()[:16]


def fingerprint(model: nn.Module, examples: list[Example], topk: int, weights: str | None = None,
                layers: tuple[int, ...] | None = None) -> str:
    """Keyed on the weights' identity (``weights``: :func:`weights_identity` of ``model``, when
    the caller has it), not the model's name: a re-saved model with the same name must not
    reuse features of its old weights. ``layers``: what an EAGLE-3 cache holds (None: the
    final hidden states)."""
    what = "" if layers is None else f"|layers={','.join(map(str, layers))}"
    h = hashlib.sha256(f"{weights or weights_identity(model)}|{topk}|{len(examples)}{what}".encode())
    for ex in examples:
        h.update(np.asarray(ex.input_ids, dtype=np.int32).tobytes())
        h.update(np.asarray(ex.loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()[:16]


def sequence_key(input_ids, loss_mask) -> bytes:
    """A digest of one sequence's token ids and loss mask: two cached sequences with the same
    key (and the same weights) hold the same features."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    return h.digest()


@dataclass
class Donor:
    """A complete earlier cache whose rows a rebuild copies instead of running the target."""

    arrays: dict[str, np.ndarray]  # FEATURES, memory-mapped read-only
    rows: dict[bytes, int]  # sequence key -> first row

    @classmethod
    def find(cls, folders: list[Path], weights: str, topk: int, hidden_size: int,
             layers: list[int] | None = None) -> list[Donor]:
        """The complete caches among ``folders`` built from the same weights with the same
        top-k, width and layers (caches written before the weights were recorded are not used)."""
        donors = []
        for folder in folders:
            info = read_meta(folder) or {}
            if ((info.get("weights"), info.get("topk"), info.get("hidden_size"), info.get("layers"))
                    != (weights, topk, hidden_size, layers)):
                continue
            tokens, mask = np.load(folder / "tokens.npy"), np.load(folder / "loss_mask.npy")
            offsets = np.load(folder / "offsets.npy", allow_pickle=False)
            rows = {sequence_key(tokens[s:e], mask[s:e]): int(s) for s, e in zip(offsets[:-1], offsets[1:])}
            arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in FEATURES}
            donors.append(cls(arrays, rows))
        return donors


def set_aside(folder: Path) -> None:
    """Move a complete but outdated cache to ``folder.previous`` (replacing an older one there),
    so its successor can be built in ``folder`` while copying rows from it."""
    if read_meta(folder) is None:
        return  # none, a build that was interrupted, or a damaged one: overwritten in place
    previous = folder.with_name(folder.name + PREVIOUS)
    if previous.exists():
        shutil.rmtree(previous)
    folder.rename(previous)


@dataclass
class FeatureCache:
    folder: Path
    hidden: np.ndarray  # [N, H] float16, or [N, L*H] bfloat16 bits as uint16 (memory-mapped)
    teacher_ids: np.ndarray  # [N, k] int32
    teacher_logp: np.ndarray  # [N, k] float16
    tokens: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] uint8
    seq_end: np.ndarray  # [N] int64: end offset of the sequence holding each position

    @classmethod
    def open(cls, folder: str | Path) -> FeatureCache:
        folder = Path(folder)
        load = lambda name: np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        offsets = np.load(folder / "offsets.npy", allow_pickle=False)
        seq_end = np.repeat(offsets[1:], np.diff(offsets))
        return cls(folder, load("hidden"), load("teacher_ids"), load("teacher_logp"),
                   np.load(folder / "tokens.npy"), np.load(folder / "loss_mask.npy"), seq_end)

    def __len__(self) -> int:
        return len(self.tokens)

    def hidden_rows(self, rows) -> torch.Tensor:
        """``hidden[rows]`` as float32, whichever dtype it is stored in."""
        raw = np.array(self.hidden[rows])  # a copy out of the read-only map
        if raw.dtype == np.uint16:
            return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).float()
        return torch.from_numpy(raw).float()

    def positions(self, num_heads: int) -> np.ndarray:
        """Source positions ``t`` where at least one head has a token to learn."""
        t = np.arange(len(self.tokens))
        ok = np.zeros(len(t), dtype=bool)
        for k in range(num_heads):
            tgt = t + k + 2
            inside = tgt < self.seq_end
            ok[inside] |= self.loss_mask[tgt[inside]].astype(bool)
        return np.nonzero(ok)[0]

    def batch(self, pos: np.ndarray, num_heads: int, device: torch.device) -> tuple[torch.Tensor, HeadTargets]:
        """Hidden states ``[N, H]`` (float32) and per-head targets for source positions ``pos``."""
        pos = np.sort(pos)  # memory-mapped reads are faster in file order
        hidden = torch.from_numpy(np.ascontiguousarray(self.hidden[pos])).float()
        n_tok = len(self.tokens)
        labels, valid, ids, logp = [], [], [], []
        for k in range(num_heads):
            tgt = pos + k + 2
            ok = tgt < self.seq_end[pos]
            tgt_c = np.minimum(tgt, n_tok - 1)
            ok &= self.loss_mask[tgt_c].astype(bool)
            labels.append(np.where(ok, self.tokens[tgt_c], -100))
            valid.append(ok)
            src = tgt_c - 1  # the target's distribution at t+k+1 is over token t+k+2
            ids.append(self.teacher_ids[src])
            logp.append(self.teacher_logp[src])
        as_t = lambda x, dt: torch.from_numpy(np.stack(x)).to(device=device, dtype=dt)  # noqa: E731
        targets = HeadTargets(as_t(labels, torch.long), as_t(valid, torch.bool), as_t(ids, torch.long),
                              as_t(logp, torch.float32))
        return hidden.to(device), targets


def is_complete(folder: str | Path, fp: str) -> bool:
    info = read_meta(Path(folder))
    return info is not None and info.get("fingerprint") == fp


def read_meta(folder: Path) -> dict | None:
    """``meta.json`` of a whole cache, or None. A cache whose meta is cut off or garbage, or
    whose arrays are missing or not the size it records (a full disk, a file cut by hand), is
    dropped with one warning line: its builder runs again."""
    meta = folder / META
    if not meta.is_file():
        return None
    try:
        info = json.loads(meta.read_bytes())
        n, width, topk = int(info["tokens"]), int(info["hidden_size"]), int(info["topk"])
        shapes = {"hidden": (n, width), "teacher_ids": (n, topk), "teacher_logp": (n, topk), "tokens": (n,),
                  "loss_mask": (n,), "offsets": (int(info["sequences"]) + 1,)}
        for name, shape in shapes.items():
            found = np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False).shape
            if found != shape:
                raise ValueError(f"{name}.npy has shape {found}, {shape} was written")
    except (OSError, ValueError, KeyError, TypeError, EOFError) as err:
        drop_cache_entry(folder, f"damaged ({(str(err).strip().splitlines() or [type(err).__name__])[0][:120]})")
        return None
    return info


def run_target(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` -> final normed hidden states ``[B, T, H]`` and logits ``[B, T, V]``."""
    out = model.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False)
    hidden = out.last_hidden_state
    return hidden, lm_logits(model, hidden)


def target_kernels(kernels: str, target: nn.Module):
    """A context running ``target``'s linear layers with ``kernels`` ("default", "onednn" or "gemv")."""
    if kernels not in KERNELS:
        raise MedusaError(f"unknown cache_kernels {kernels!r}: use one of {', '.join(KERNELS)}")
    if kernels == "default":
        return contextlib.nullcontext()
    weight = target.get_output_embeddings().weight
    if kernels == "gemv" and not gemv.available(weight.device, weight.dtype):
        raise MedusaError(f"cache_kernels: gemv needs a float32 target on a CPU where the kernels build "
                          f"({gemv.unavailable_reason() or f'not {weight.dtype} on {weight.device.type}'}): use default")
    if kernels == "onednn" and not onednn_available(weight.device, weight.dtype):
        raise MedusaError(f"cache_kernels: onednn needs the target on a CPU whose torch build packs {weight.dtype} linears: "
                          "use default")
    return PackedLinears(target, kernels=kernels)


def run_layers(model: nn.Module, layers: tuple[int, ...], ids: torch.Tensor, attn: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` -> the residual stream entering ``layers``, concatenated ``[B, T, L*H]``, and
    the logits ``[B, T, V]`` (what EAGLE-3 training reads; ``eagle3_ttt.target_outputs``)."""
    out = model.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1), lm_logits(model, out.last_hidden_state)
