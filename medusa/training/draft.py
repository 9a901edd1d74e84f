"""Distilling a draft model: one explicit loop, the draft learns the target's next-token law.

Read top to bottom: config -> target, data -> draft (the target's first layers, or a
folder) -> optional feature cache -> optimizer -> loop (loss on every position, clip,
step, log, eval) -> a normal Hugging Face model folder. ``accelerate`` provides device
and DDP.

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
import math
import time
from collections.abc import Iterable, Iterator
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
    TargetFields,
    arg,
    override,
    to_dict,
)
from medusa.decoding.hf import lm_logits
from medusa.errors import MedusaError
from medusa.models.checkpoint import atomic_folder
from medusa.models.draft import DEFAULT_DRAFT_LAYERS, default_draft_dir, shallow_draft
from medusa.models.target import load_target
from medusa.training.data import DataSplits, Example, build_datasets
from medusa.training.feature_cache import FeatureCache, build_cache, fingerprint, is_complete
from medusa.training.loop import Schedule, collate, run_target
from medusa.training.losses import frequent_tokens, soft_cross_entropy

log = logging.getLogger("medusa.training.draft")

RECORD = "draft_training.json"


@dataclass
class DraftTrainConfig(EvalFields, OptimFields, CacheFields, DataFields, TargetFields):
    """Distil a draft model for draft-model speculative decoding (KL to the target's next-token distribution)."""

    # Shared fields (target, data, feature cache, optimisation, evaluation: medusa/config.py)
    # with the defaults that suit a draft.
    max_samples: int | None = override(DataFields, "max_samples", 4000)
    max_length: int = override(DataFields, "max_length", 256)
    train_vocab: int = override(CacheFields, "train_vocab", 8192)
    lr: float = override(OptimFields, "lr", 3e-4)
    eval_every: int = override(EvalFields, "eval_every", 100)
    eval_batches: int = override(EvalFields, "eval_batches", 10)
    # -- draft --
    init: str | None = arg(None, "start from this draft folder (empty: the target's first draft_layers layers)")
    draft_layers: int = arg(DEFAULT_DRAFT_LAYERS, "decoder layers of the shallow draft (when init is empty)")
    train_embeddings: bool = arg(False, "also train the embeddings and output projection (tied in small models)")
    # -- data, objective --
    assistant_only: bool = arg(False, "distil only on assistant tokens (default: every token of the conversation)")
    temperature: float = arg(1.0, "softmax temperature of both distributions in the KL")
    # -- schedule (cosine), output --
    max_minutes: float = arg(0.0, "stop after this many minutes of training (after at least one step) and save "
                                  "what there is (0: no limit)")
    output_dir: str | None = arg(None, "where the draft folder is written (empty: for the embedded target, the cache "
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
        if self.output_dir:
            return Path(self.output_dir)
        return default_draft_dir() if self.model is None else Path("out/draft")


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


def cache_batch(cache: FeatureCache, spans: np.ndarray, idx: np.ndarray, device: torch.device,
                assistant_only: bool) -> Batch:
    chosen = spans[idx]  # [B, 2]
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
    ids = index[teacher_ids]  # [n, k]
    inside = ids >= 0
    kl, _ = soft_cross_entropy(logq, ids.clamp(min=0), teacher_logp.masked_fill(~inside, -1e4))
    return (kl * inside.any(-1)).sum() / inside.any(-1).sum().clamp(min=1)


def evaluate(draft: nn.Module, target: nn.Module, batches: Iterable[Batch], temperature: float) -> dict[str, float]:
    """Held-out KL to the target and argmax agreement with it."""
    draft.eval()
    kl_sum, agree, rows_seen = 0.0, 0, 0
    with torch.no_grad():
        for batch in batches:
            teacher = teacher_logits(target, batch)
            student = project(draft, final_hidden(draft, batch))
            kl, hits = distill_loss(student, teacher, temperature)
            kl_sum += float(kl) * len(teacher)
            agree += int(hits)
            rows_seen += len(teacher)
    draft.train()
    return {"kl": kl_sum / max(rows_seen, 1), "agreement": agree / max(rows_seen, 1), "positions": rows_seen}


def open_caches(cfg: DraftTrainConfig, target: nn.Module, splits: DataSplits, accelerator: Any,
                progress: bool) -> dict[str, FeatureCache]:
    """The feature caches of both splits, built by running the target once where missing.

    The fingerprint is the one ``train/train_heads.py`` computes, so the same data settings
    and ``cache_dir`` share one cache between heads and draft.
    """
    from tqdm.auto import tqdm

    caches: dict[str, FeatureCache] = {}
    vocab, hidden_size = target.get_output_embeddings().weight.shape
    topk = min(cfg.teacher_topk, vocab)  # as train_heads.py caps it, so the fingerprints agree
    for split, examples in (("train", splits.train), ("eval", splits.eval)):
        if not examples:
            continue
        folder = Path(cfg.cache_dir) / split
        fp = fingerprint(target, examples, topk)
        if not is_complete(folder, fp):
            world = accelerator.num_processes
            bar = tqdm(total=sum(len(e) for e in examples) // world, desc=f"cache {split}", unit="tok",
                       disable=not progress)
            build_cache(folder, lambda i, a: run_target(target, i, a), examples, hidden_size, topk, fp,
                        accelerator.process_index, world, accelerator.wait_for_everyone, accelerator.device,
                        progress=bar.update)
            bar.close()
        caches[split] = FeatureCache.open(folder)
    return caches


def train_draft(cfg: DraftTrainConfig) -> Path:
    """Run the distillation as configured; returns the draft folder."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    main = accelerator.is_main_process
    set_seed(cfg.seed)
    t0 = time.time()

    # The target is the frozen teacher; the draft starts as its early exit (or a folder).
    target, tokenizer = load_target(cfg.model, device=device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    if cfg.init:
        draft, _ = load_target(cfg.init, device=device, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
    else:
        draft = shallow_draft(target, cfg.draft_layers)
    draft = draft.float().train()
    draft.requires_grad_(True)
    if not cfg.train_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    if main:
        log.info("draft: %d layers, %.1fM parameters (%.1fM trained); accelerate: %d process(es) on %s",
                 draft.config.num_hidden_layers, sum(p.numel() for p in draft.parameters()) / 1e6,
                 sum(p.numel() for p in params) / 1e6, world, device)

    splits: DataSplits = build_datasets(tokenizer, cfg.data, cfg.max_length, cfg.max_samples, cfg.eval_fraction,
                                        seed=cfg.data_seed, split=cfg.data_split, progress=main)
    if main:
        log.info("data: %d train / %d held-out sequences (%s)", len(splits.train), len(splits.eval),
                 splits.stats.summary())

    # Batches come from the sequences (the target runs every step) or from a feature
    # cache (the target never runs; KL to its cached top-k over a frequent-token subset).
    vocab = index = None
    if cfg.cache_dir:
        caches = open_caches(cfg, target, splits, accelerator, main)
        spans = {split: cache_spans(c) for split, c in caches.items()}
        size = draft.get_output_embeddings().weight.shape[0]
        if 0 < cfg.train_vocab < size:
            vocab = frequent_tokens(torch.from_numpy(caches["train"].tokens.astype(np.int64)), cfg.train_vocab,
                                    size).to(device)  # [S]
            index = torch.full((size,), -1, dtype=torch.long, device=device)
            index[vocab] = torch.arange(len(vocab), device=device)

        def get_batch(split: str, idx: np.ndarray) -> Batch:
            return cache_batch(caches[split], spans[split], idx, device, cfg.assistant_only)

        sizes = {split: len(s) for split, s in spans.items()}
    else:
        examples = {"train": splits.train, "eval": splits.eval}

        def get_batch(split: str, idx: np.ndarray) -> Batch:
            return sequence_batch(examples[split], idx, device, cfg.assistant_only)

        sizes = {split: len(e) for split, e in examples.items() if e}

    def eval_batches() -> Iterator[Batch]:
        n = sizes.get("eval", 0)
        count = math.ceil(n / cfg.batch_size)
        for b in range(min(count, cfg.eval_batches) if cfg.eval_batches > 0 else count):
            yield get_batch("eval", np.arange(b * cfg.batch_size, min((b + 1) * cfg.batch_size, n)))

    schedule = Schedule(sizes["train"], cfg.batch_size, world, cfg.grad_accum, cfg.seed)
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, int(cfg.num_epochs * schedule.steps_per_epoch))

    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    draft, opt = accelerator.prepare(draft, opt)
    history: list[dict[str, float]] = []
    has_eval = main and sizes.get("eval", 0) > 0
    before = evaluate(accelerator.unwrap_model(draft), target, eval_batches(), cfg.temperature) if has_eval else {}
    if before:
        log.info("before: held-out KL %.3f, argmax agreement %.3f", before["kl"], before["agreement"])
    bar = tqdm(total=total, desc="distil draft", disable=not main)
    loss_name = "top-k KL" if cfg.cache_dir else "KL"
    step, start = 0, time.time()
    deadline = start + cfg.max_minutes * 60 if cfg.max_minutes > 0 else math.inf
    while step < total and (step == 0 or time.time() < deadline):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss_sum, rows_seen = 0.0, 0
        for micro in range(cfg.grad_accum):
            batch = get_batch("train", schedule.micro_batch(step, micro, rank))
            with accelerator.accumulate(draft):
                student = final_hidden(draft, batch)  # [n, H]
                if batch.teacher_ids is not None:
                    loss = topk_distill_loss(accelerator.unwrap_model(draft), student, batch.teacher_ids,
                                             batch.teacher_logp, vocab, index)
                else:
                    loss, _ = distill_loss(project(accelerator.unwrap_model(draft), student),
                                           teacher_logits(target, batch), cfg.temperature)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss_sum += float(loss.detach()) * len(student)
            rows_seen += len(student)
        step += 1
        bar.update(1)
        if main and (step % cfg.log_every == 0 or step == 1):
            bar.set_postfix(loss=f"{loss_sum / max(rows_seen, 1):.3f}")
            log.info("step %d/%d: %s %.3f, lr %.2e, %.1f s/step", step, total, loss_name, loss_sum / max(rows_seen, 1),
                     lr_at(step - 1), (time.time() - start) / step)
        if has_eval and cfg.eval_every > 0 and step % cfg.eval_every == 0:
            metrics = evaluate(accelerator.unwrap_model(draft), target, eval_batches(), cfg.temperature)
            history.append({"step": step, **metrics})
            log.info("step %d: held-out KL %.3f, argmax agreement %.3f", step, metrics["kl"], metrics["agreement"])
    bar.close()
    if step < total and main:
        log.info("time limit of %g minutes reached after %d of %d steps", cfg.max_minutes, step, total)

    accelerator.wait_for_everyone()
    out = cfg.output_path()
    if main:
        unwrapped = accelerator.unwrap_model(draft)
        after = evaluate(unwrapped, target, eval_batches(), cfg.temperature) if has_eval else {}
        if after:
            log.info("after %d steps: held-out KL %.3f, argmax agreement %.3f", step, after["kl"], after["agreement"])
        record = {"config": to_dict(cfg), "steps": step, "planned_steps": total,
                  "train_seconds": round(time.time() - t0, 1), "eval_before": before, "eval_after": after,
                  "eval_history": history}
        save_draft(unwrapped, tokenizer, out, record)
    accelerator.wait_for_everyone()
    return out


def save_draft(draft: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path, record: dict) -> None:
    """A normal model folder (safetensors, config, tokenizer) plus the run record, written
    to a sibling folder and swapped in, so a reader never sees half a model."""
    draft.eval().requires_grad_(False)
    with atomic_folder(out) as tmp:
        draft.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
