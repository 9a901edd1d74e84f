"""Micro-batches for the one training loop: which items a step reads, and how they are fetched.

A task (heads, draft) describes its data as :class:`Batches`: an array of *items* (example
indices, feature-cache positions, cached sequence bounds), how many make a micro-batch,
and a ``fetch`` that turns chosen items into a batch on the device. The loop reads training
batches through a torch ``DataLoader`` whose batch sampler is :class:`StepSampler`:
micro-batch ``(step, micro, rank)`` holds a pure function of ``(seed, epoch, step)``, so
``accelerator.skip_first_batches`` puts a resumed run exactly where the uninterrupted one
was. ``accelerator.prepare_data_loader`` shards the sampler's batches over the processes.

Evaluation batches (:meth:`Batches.in_order`) stay a plain generator: every process must run
the same number of forwards (ZeRO-3 gathers parameters collectively) while each held-out
item is counted once, so padding batches are marked as not counted, which a sharded
``DataLoader`` (it repeats items to even out the processes) cannot say.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from medusa.training.data import Example


@dataclass
class Schedule:
    """Where a global optimizer step reads its data: pure arithmetic, hence resumable."""

    num_items: int
    per_micro: int  # items per micro-batch per process
    world: int
    accum: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.num_items // (self.per_micro * self.world * self.accum))

    def order(self, epoch: int) -> np.ndarray:
        g = torch.Generator().manual_seed(self.seed + 1000003 * epoch)
        return torch.randperm(self.num_items, generator=g).numpy()

    def micro_batch(self, step: int, micro: int, rank: int, order: np.ndarray | None = None) -> np.ndarray:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self.order(epoch) if order is None else order
        start = ((within * self.accum + micro) * self.world + rank) * self.per_micro
        idx = order[start: start + self.per_micro]
        if len(idx) < self.per_micro:  # fewer items than one global batch: wrap around
            idx = np.resize(order, start + self.per_micro)[start:]
        return idx


class StepSampler(Sampler[list[int]]):
    """Every micro-batch of ``total`` steps in the order ``step, micro, rank``: after
    sharding over ``world`` processes, process ``r`` reads ``Schedule.micro_batch(step, micro, r)``."""

    def __init__(self, schedule: Schedule, total: int) -> None:
        self.schedule, self.total = schedule, total

    def __len__(self) -> int:
        return self.total * self.schedule.accum * self.schedule.world

    def __iter__(self) -> Iterator[list[int]]:
        s = self.schedule
        epoch, order = -1, None
        for step in range(self.total):
            if step // s.steps_per_epoch != epoch:  # one permutation per epoch, not per batch
                epoch = step // s.steps_per_epoch
                order = s.order(epoch)
            for micro in range(s.accum):
                for rank in range(s.world):
                    yield s.micro_batch(step, micro, rank, order).tolist()


class _Positions(torch.utils.data.Dataset):
    """Item ``i`` is ``i``: the batch's ``fetch`` reads the items, vectorised."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@dataclass
class Batches:
    """A split's data: ``items`` ``[N, ...]``, ``per`` of them per micro-batch per process, and
    ``fetch(items[idx]) -> batch`` (tensors already on the device)."""

    items: np.ndarray
    per: int
    fetch: Callable[[np.ndarray], Any]

    def get(self, idx: np.ndarray) -> Any:
        return self.fetch(self.items[idx])

    def schedule(self, world: int, accum: int, seed: int) -> Schedule:
        return Schedule(len(self.items), self.per, world, accum, seed)

    def loader(self, accelerator: Any, accum: int, seed: int, total: int, skip_steps: int = 0) -> DataLoader:
        """Training micro-batches for this process, ``accum`` per step, from step ``skip_steps``."""
        sampler = StepSampler(self.schedule(accelerator.num_processes, accum, seed), total)
        loader = DataLoader(_Positions(len(self.items)), batch_sampler=sampler,
                            collate_fn=lambda idx: self.get(np.asarray(idx)))
        loader = accelerator.prepare_data_loader(loader, device_placement=False)  # fetch places them
        return accelerator.skip_first_batches(loader, skip_steps * accum) if skip_steps else loader

    def in_order(self, rank: int, world: int, limit: int) -> Iterator[tuple[Any, bool]]:
        """Evaluation batches in fixed order, split over ranks, as ``(batch, counts)``.

        Every rank runs the same number of forwards (sharded ZeRO-3 parameters are gathered
        collectively); a rank past the end reruns batch 0 with ``counts=False``.
        """
        n_batches = math.ceil(len(self.items) / self.per)
        if limit > 0:
            n_batches = min(n_batches, limit)
        for b in range(rank, math.ceil(n_batches / world) * world, world):
            keep = b < n_batches
            b = b if keep else 0
            yield self.get(np.arange(b * self.per, min((b + 1) * self.per, len(self.items)))), keep


def collate(examples: list[Example], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, T]`` ids, attention mask and loss mask."""
    width = max(len(e) for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for b, e in enumerate(examples):
        ids[b, : len(e)] = torch.tensor(e.input_ids)
        attn[b, : len(e)] = 1
        mask[b, : len(e)] = torch.tensor(e.loss_mask)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": mask.to(device)}
