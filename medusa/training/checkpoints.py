"""Checkpoints of the training loop: ``accelerator.save_state`` written atomically.

``OUTPUT/checkpoints/step-N`` holds what ``accelerator.save_state`` writes (the trainable
weights, optimizer, registered learning-rate scheduler, every process's RNG state; under
DeepSpeed its own sharded format) plus ``trainer.json`` (step and config). It is written
into a temporary folder, renamed into place, and only then does the ``latest`` pointer
move: a crash at any moment leaves the previous checkpoint usable.

Not accelerate's ``automatic_checkpoint_naming``: it writes in place (a crash leaves half a
checkpoint that looks like the newest) and numbers checkpoints by save count, not by step.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from medusa.config import to_dict
from medusa.errors import MedusaError
from medusa.runtime.files import atomic_file

log = logging.getLogger("medusa.training.checkpoints")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
RECORD = "trainer.json"


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = output_dir / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = output_dir / CHECKPOINTS / pointer.read_text().strip()
    return path if (path / RECORD).is_file() else None


def trainable_only(models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
    """``save_state`` pre-hook: keep only trainable parameters (a LoRA target's frozen base
    weights, a draft's frozen embeddings are the model's own and need no copy per checkpoint)."""
    for model, state in zip(models, weights):
        keep = {name for name, p in model.named_parameters() if p.requires_grad}
        for name in [k for k in state if k not in keep]:
            del state[name]


def save_checkpoint(accelerator: Any, step: int, cfg: Any, out: Path) -> Path:
    """Write ``checkpoints/step-N`` (a collective: every process calls it)."""
    from accelerate.utils import broadcast_object_list

    root = out / CHECKPOINTS
    final = root / f"step-{step:07d}"
    shared = [str(tempfile.mkdtemp(prefix=".tmp-", dir=root)) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(shared, from_process=0)
    tmp = Path(shared[0])
    accelerator.save_state(str(tmp))
    # Every process writes its own files (its RNG state; ZeRO shards) and save_state does not
    # wait for the others: rename the folder only once all of them are done.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / RECORD).write_text(json.dumps({"step": step, "config": to_dict(cfg)}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        with atomic_file(root / LATEST) as pointer:
            pointer.write_text(final.name)
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[: max(0, len(done) - cfg.keep_checkpoints)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, module: nn.Module, path: Path) -> int:
    """Restore what :func:`save_checkpoint` wrote into the prepared objects; returns its step."""
    if accelerator.distributed_type.name == "DEEPSPEED":
        accelerator.load_state(str(path))
    else:
        from safetensors import safe_open

        with safe_open(path / "model.safetensors", framework="pt") as saved:
            # save_state wrote the unwrapped module's names (no DDP "module." prefix)
            trainable = {n for n, p in accelerator.unwrap_model(module).named_parameters() if p.requires_grad}
            missing = trainable - set(saved.keys())
        if missing:
            raise MedusaError(f"checkpoint {path} does not match this run (missing {sorted(missing)[:3]}): "
                              "resume with the config that wrote it")
        accelerator.load_state(str(path), strict=False)  # frozen weights are not in it (trainable_only)
    return int(json.loads((path / RECORD).read_text())["step"])
