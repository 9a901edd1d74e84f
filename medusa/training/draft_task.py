"""Distilling a draft model: what the one loop (``loop.py``) trains for a ``DraftTrainConfig``.

The draft starts as the target's first layers (or a folder) and learns the target's
next-token law; the output is a normal Hugging Face model folder. The loop brings
checkpoints, ``resume``, held-out evaluation, metrics and wandb, as for heads.

The loss compares the draft to the target's own distribution, not to the data's tokens:
the draft is judged by how often it guesses what the target would say, so that is what it
learns. Without a cache it is ``KL(target || draft)`` over the whole vocabulary, the
target running every step. With ``cache_dir`` the target's outputs (final hidden states
and top-k next-token log-probabilities) come from a feature cache shared with heads
training, so the target never runs while training, and the KL is taken against the
target's top-k with the draft's softmax over the ``train_vocab`` most frequent tokens:
several times cheaper per step on a CPU, where the target's pass and the vocabulary
projection dominate. (A squared logit gap, computable in hidden space without any
projection, was tried first: it fits the vocabulary's long tail and barely moves the
argmax agreement that acceptance depends on.)
The vocabulary projection (tied to the embeddings in small models) stays the target's
unless ``train_embeddings`` is set, so only the few decoder layers and the final norm
train; that also skips the largest weight gradient.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from medusa.config import (
    CacheFields,
    DataFields,
    EvalFields,
    OptimFields,
    RunFields,
    TargetFields,
    arg,
    override,
    to_dict,
)
from medusa.errors import MedusaError
from medusa.models.draft import DEFAULT_DRAFT_LAYERS, default_draft_dir, shallow_draft
from medusa.models.target import load_target
from medusa.runtime.files import atomic_folder
from medusa.runtime.hf import lm_logits
from medusa.training.batches import Batches, collate
from medusa.training.checkpoints import CHECKPOINTS
from medusa.training.data import DataSplits, Example
from medusa.training.feature_build import open_caches
from medusa.training.feature_cache import FeatureCache
from medusa.training.losses import frequent_tokens, soft_cross_entropy, teacher_in_vocab, vocab_index

log = logging.getLogger("medusa.training.draft_task")

RECORD = "draft_training.json"


@dataclass
class DraftTrainConfig(RunFields, EvalFields, OptimFields, CacheFields, DataFields, TargetFields):
    """Distil a draft model for draft-model speculative decoding (KL to the target's next-token distribution)."""

    # Shared fields (target, data, feature cache, optimisation, evaluation, checkpoints and
    # logging: medusa/config.py) with the defaults that suit a draft.
    max_samples: int | None = override(DataFields, "max_samples", 4000)
    max_length: int = override(DataFields, "max_length", 256)
    train_vocab: int = override(CacheFields, "train_vocab", 8192)
    lr: float = override(OptimFields, "lr", 3e-4)
    adam_beta2: float = override(OptimFields, "adam_beta2", 0.95)
    eval_every: int = override(EvalFields, "eval_every", 100)
    eval_batches: int = override(EvalFields, "eval_batches", 10)
    # -- draft --
    init: str | None = arg(None, "start from this draft folder (empty: the target's first draft_layers layers)")
    draft_layers: int = arg(DEFAULT_DRAFT_LAYERS, "decoder layers of the shallow draft (when init is empty)",
                            bounds=(1, None))
    train_embeddings: bool = arg(False, "also train the embeddings and output projection (tied in small models)")
    # -- data, objective --
    assistant_only: bool = arg(False, "distil only on assistant tokens (default: every token of the conversation)")
    temperature: float = arg(1.0, "softmax temperature of both distributions in the KL")
    # -- output --
    output: str | None = arg(None, "where the draft folder is written (empty: for the embedded target, the cache "
                                   "folder medusa.load(draft='default') reads; otherwise out/draft)")

    def __post_init__(self) -> None:
        if self.max_steps <= 0 and self.num_epochs <= 0:
            raise MedusaError("set max_steps or num_epochs to a positive number")
        if self.temperature <= 0:
            raise MedusaError(f"temperature must be > 0, got {self.temperature}")
        if self.cache_dir and self.train_embeddings:
            raise MedusaError("a feature cache needs the vocabulary projection frozen: "
                              "drop cache_dir or train_embeddings")

    def output_path(self) -> Path:
        if self.output:
            return Path(self.output)
        return default_draft_dir() if self.model is None else Path("out/draft")


# -- batches and losses ------------------------------------------------------------------------------

@dataclass
class Batch:
    """Right-padded sequences and where the loss reads them.

    When the target's outputs come from a feature cache, ``teacher_hidden`` ``[n, H]`` is
    its final normed hidden state at the ``n`` set ``rows`` and ``teacher_ids`` /
    ``teacher_logp`` ``[n, k]`` its top-k next tokens there; otherwise the target runs.
    """

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    rows: torch.Tensor  # [B, T] bool
    teacher_hidden: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None


def sequence_batch(examples: list[Example], idx: np.ndarray, device: torch.device, assistant_only: bool) -> Batch:
    b = collate([examples[i] for i in idx], device)
    rows = (b["loss_mask"] if assistant_only else b["attention_mask"]).bool()
    return Batch(b["input_ids"], b["attention_mask"], rows)


def cache_spans(cache: FeatureCache) -> np.ndarray:
    """``[S, 2]`` start and end of every sequence stored in ``cache``."""
    ends = np.unique(cache.seq_end)
    return np.stack([np.concatenate([[0], ends[:-1]]), ends], axis=1)


def cache_batch(cache: FeatureCache, chosen: np.ndarray, device: torch.device, assistant_only: bool) -> Batch:
    """The cached sequences ``chosen`` ``[B, 2]`` (start, end) as a batch."""
    width = int((chosen[:, 1] - chosen[:, 0]).max())
    ids = torch.zeros((len(chosen), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    rows = torch.zeros_like(ids, dtype=torch.bool)
    positions = []
    for b, (lo, hi) in enumerate(chosen):
        n = hi - lo
        ids[b, :n] = torch.from_numpy(cache.tokens[lo:hi].astype(np.int64))
        attn[b, :n] = 1
        keep = cache.loss_mask[lo:hi].astype(bool) if assistant_only else np.ones(n, dtype=bool)
        rows[b, :n] = torch.from_numpy(keep)
        positions.append(np.arange(lo, hi)[keep])
    pos = np.concatenate(positions)  # [n] in row order, the order hidden[rows] reads

    def load(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.asarray(array[pos])).to(device=device, dtype=dtype)

    return Batch(ids.to(device), attn.to(device), rows.to(device), load(cache.hidden, torch.float32),
                 load(cache.teacher_ids, torch.long), load(cache.teacher_logp, torch.float32))


def final_hidden(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The final normed hidden state ``[n, H]`` at the batch's rows (what the projection reads)."""
    out = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.last_hidden_state[batch.rows]


def project(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``[n, H]`` -> fp32 logits ``[n, V]``, exactly as the model computes them."""
    return lm_logits(model, hidden).float()


def teacher_logits(target: nn.Module, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        hidden = batch.teacher_hidden if batch.teacher_hidden is not None else final_hidden(target, batch)
        return project(target, hidden)  # [n, V]


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``KL(teacher || student)`` over rows ``[n, V]`` and how many rows agree on the argmax
    (the greedy acceptance rate of a one-token draft)."""
    t = torch.log_softmax(teacher / temperature, dim=-1)
    s = torch.log_softmax(student / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1).mean()
    agree = (student.argmax(-1) == teacher.argmax(-1)).sum()
    return kl, agree


def topk_distill_loss(model: nn.Module, hidden: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
                      vocab: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor:
    """Mean ``KL(p || q)`` with ``p`` the target's cached top-k (renormalised) and ``q`` the
    draft's softmax, over the whole vocabulary or only the subset ``vocab`` ``[S]``.

    ``hidden`` ``[n, H]`` is the draft's final normed hidden state; ``index`` ``[V]`` maps a
    token id to its place in ``vocab`` (-1 outside). Teacher ids outside the subset are
    dropped; a row with none left contributes nothing.
    """
    weight = model.get_output_embeddings().weight  # [V, H]
    logits = hidden @ (weight if vocab is None else weight[vocab]).T  # [n, V or S]
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    logq = torch.log_softmax(logits.float(), dim=-1)
    if index is None:
        kl, _ = soft_cross_entropy(logq, teacher_ids, teacher_logp)
        return kl.mean()
    ids, logp, keep, _ = teacher_in_vocab(teacher_ids, teacher_logp, index)
    kl, _ = soft_cross_entropy(logq, ids, logp)
    return (kl * keep).sum() / keep.sum().clamp(min=1)


# -- what gets trained ------------------------------------------------------------------------------

class DraftTrainer(nn.Module):
    """The module handed to ``accelerator.prepare``: the draft, with the frozen target held
    by reference (neither wrapped, sharded nor saved). Its forward takes a :class:`Batch` and
    returns ``(loss, counts)``: ``rows``, the summed ``kl`` and, when the full distributions
    are compared, argmax agreements ``agree``.

    Training from a feature cache takes the KL to the target's cached top-k over the
    ``vocab`` subset; evaluation always compares full distributions, as decoding does.
    """

    def __init__(self, draft: nn.Module, target: nn.Module, cfg: DraftTrainConfig,
                 vocab: torch.Tensor | None = None, index: torch.Tensor | None = None) -> None:
        super().__init__()
        self.draft, self.cfg, self.vocab, self.index = draft, cfg, vocab, index
        self._frozen = (target,)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        student = final_hidden(self.draft, batch)  # [n, H]
        rows = torch.tensor(float(len(student)), device=student.device)
        if self.training and batch.teacher_ids is not None:
            loss = topk_distill_loss(self.draft, student, batch.teacher_ids, batch.teacher_logp, self.vocab, self.index)
            return loss, {"rows": rows, "kl": loss.detach() * rows}
        loss, agree = distill_loss(project(self.draft, student), teacher_logits(self._frozen[0], batch),
                                   self.cfg.temperature)
        return loss, {"rows": rows, "kl": loss.detach() * rows, "agree": agree.float()}


@dataclass
class DraftTask:
    """A draft model for a target: the module, its batches, its metrics and its output folder."""

    cfg: DraftTrainConfig

    def build(self, accelerator: Any, target: nn.Module, splits: DataSplits) -> tuple[DraftTrainer, Batches, Batches | None]:
        draft = self.draft(target, accelerator)
        cfg, device, vocab, index = self.cfg, accelerator.device, None, None
        if cfg.cache_dir:
            # The target never runs while training: KL to its cached top-k, over a frequent-token subset.
            caches = open_caches(cfg, target, splits, accelerator)
            size = draft.get_output_embeddings().weight.shape[0]
            if 0 < cfg.train_vocab < size:
                vocab = frequent_tokens(torch.from_numpy(caches["train"].tokens.astype(np.int64)), cfg.train_vocab,
                                        size, splits.fill).to(device)  # [S]
                index = vocab_index(vocab, size)
            train, held_out = (self.cached(caches.get(split), device) for split in ("train", "eval"))
        else:
            train, held_out = (self.sequences(examples, device) for examples in (splits.train, splits.eval))
        return DraftTrainer(draft, target, cfg, vocab, index), train, held_out

    def draft(self, target: nn.Module, accelerator: Any) -> nn.Module:
        """The target's early exit (or the ``init`` folder) in fp32; the vocabulary projection
        stays the target's unless ``train_embeddings``."""
        cfg = self.cfg
        if cfg.init:
            draft, _ = load_target(cfg.init, device=accelerator.device, dtype=torch.float32,
                                   trust_remote_code=cfg.trust_remote_code)
        else:
            draft = shallow_draft(target, cfg.draft_layers)
        draft = draft.float().train()
        draft.requires_grad_(True)
        if not cfg.train_embeddings:
            draft.get_input_embeddings().requires_grad_(False)
            draft.get_output_embeddings().requires_grad_(False)
        if accelerator.is_main_process:
            trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
            log.info("draft: %d layers, %.1fM parameters (%.1fM trained)", draft.config.num_hidden_layers,
                     sum(p.numel() for p in draft.parameters()) / 1e6, trained / 1e6)
        return draft

    def sequences(self, examples: list[Example], device: torch.device) -> Batches | None:
        if not examples:
            return None
        return Batches(np.arange(len(examples)), self.cfg.batch_size,
                       lambda ix: sequence_batch(examples, ix, device, self.cfg.assistant_only))

    def cached(self, cache: FeatureCache | None, device: torch.device) -> Batches | None:
        if cache is None:
            return None
        return Batches(cache_spans(cache), self.cfg.batch_size,
                       lambda chosen: cache_batch(cache, chosen, device, self.cfg.assistant_only))

    def param_groups(self, module: DraftTrainer) -> list[dict[str, Any]]:
        """Weight decay on matrices only."""
        params = [p for p in module.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.ndim >= 2], "lr": self.cfg.lr, "weight_decay": self.cfg.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "lr": self.cfg.lr, "weight_decay": 0.0}]

    def summarise(self, counts: dict[str, torch.Tensor]) -> dict[str, float]:
        """Summed counts -> mean KL to the target (``kl``), argmax ``agreement`` (the greedy
        acceptance rate of a one-token draft) and the number of ``positions``."""
        rows = float(counts["rows"].sum())
        out = {"kl": float(counts["kl"].sum()) / max(rows, 1), "positions": int(rows)}
        if "agree" in counts:
            out["agreement"] = float(counts["agree"].sum()) / max(rows, 1)
        return out

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"kl": f"{metrics['kl']:.3f}"}

    def save(self, accelerator: Any, module: nn.Module, tokenizer: Any, step: int, total: int,
             evals: list[dict[str, Any]], seconds: float) -> Path:
        """The draft folder, with the run record: evaluations before (a run started at step 0),
        every ``eval_every`` steps, and after."""
        cfg, out = self.cfg, self.cfg.output_path()
        state = accelerator.get_state_dict(module)  # a collective: gathers ZeRO-3 partitions
        if accelerator.is_main_process:
            strip = lambda e: {k: v for k, v in e.items() if k != "step"}  # noqa: E731
            record = {"config": to_dict(cfg), "steps": step, "planned_steps": total, "train_seconds": round(seconds, 1),
                      "eval_before": strip(evals[0]) if evals and evals[0]["step"] == 0 else {},
                      "eval_after": strip(evals[-1]) if evals else {},
                      "eval_history": [e for e in evals if cfg.eval_every > 0 and e["step"] > 0
                                       and e["step"] % cfg.eval_every == 0]}
            draft_state = {k[len("draft."):]: v for k, v in state.items() if k.startswith("draft.")}
            save_draft(accelerator.unwrap_model(module).draft, tokenizer, out, record, draft_state)
        accelerator.wait_for_everyone()
        return out


def save_draft(draft: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path, record: dict,
               state: dict[str, torch.Tensor] | None = None) -> None:
    """A normal model folder (safetensors, config, tokenizer) plus the run record, written
    to a sibling folder and swapped in, so a reader never sees half a model. The training
    checkpoints, metrics and wandb logs in ``out`` are kept."""
    draft.eval().requires_grad_(False)
    with atomic_folder(out, keep_other_files=True, keep_folders=(CHECKPOINTS, "wandb")) as tmp:
        draft.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
