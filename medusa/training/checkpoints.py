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
from medusa.runtime.files import atomic_file, safetensors_problem

log = logging.getLogger("medusa.training.checkpoints")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
RECORD = "trainer.json"


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return None


def claim_output(output_dir: Path, resume: bool, overwrite: bool, main: bool) -> None:
    """Make ``output_dir/checkpoints`` this run's before it writes any: a fresh run (no
    ``resume``) into a folder holding an earlier run's checkpoints is refused in one line, since
    rotating them would delete its own newest checkpoint and ``latest`` would name the old run;
    with ``overwrite`` the earlier checkpoints are deleted (by the main process) instead."""
    root = output_dir / CHECKPOINTS
    if resume or not root.is_dir():
        return
    earlier = sorted((p for p in root.iterdir() if p.name == LATEST or (p.is_dir() and p.name.startswith("step-"))),
                     key=lambda p: (_step_of(p) or -1, p.name))
    if not earlier:
        return
    if not overwrite:
        newest = next((p.name for p in reversed(earlier) if p.name != LATEST), LATEST)
        raise MedusaError(f"{root} holds an earlier run's checkpoints ({newest}): pass --resume to continue it, "
                          "--overwrite to delete them and start again, or another --output")
    if main:
        log.warning("--overwrite: deleting the earlier run's %d checkpoint(s) in %s",
                    sum(p.name != LATEST for p in earlier), root)
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint (the ``latest`` pointer's, else the newest whole one
    before it), or None."""
    return next((path for path, problem in _candidates(output_dir) if problem is None), None)


def resume_point(output_dir: Path) -> Path | None:
    """:func:`latest_checkpoint`, saying in one line which incomplete checkpoints (a crash, a
    copy cut short) it skipped; a :class:`MedusaError` when checkpoints exist but none is whole."""
    skipped = []
    for path, problem in _candidates(output_dir):
        if problem is None:
            if skipped:
                log.warning("resume: %s; resuming from %s instead", "; ".join(skipped), path.name)
            return path
        skipped.append(f"{path} is incomplete ({problem})")
    if skipped:
        raise MedusaError(f"{skipped[0]}, and no earlier checkpoint is whole: delete the partial checkpoint(s) "
                          f"in {output_dir / CHECKPOINTS} and train again without --resume")
    return None


def _candidates(output_dir: Path) -> list[tuple[Path, str | None]]:
    """The checkpoints to resume from, newest first (the ``latest`` pointer's first), each with
    why it cannot be resumed from (None: it can)."""
    root = output_dir / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return []
    named = root / pointer.read_text(errors="replace").strip()
    older = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    if named in older:
        older = [named] + [p for p in older if p.name < named.name]
    return [(path, checkpoint_problem(path)) for path in older]


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from, or None: ``trainer.json`` must
    parse and every file it lists must be there at its recorded size, safetensors files whole."""
    try:
        record = json.loads((path / RECORD).read_bytes())
        int(record["step"])
    except FileNotFoundError:
        return f"no {RECORD}"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{RECORD} is damaged: {str(err)[:80]}"
    for rel, size in record.get("files", {}).items():  # checkpoints written before the list: not checked
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        if file.stat().st_size != size:
            return f"{rel} has {file.stat().st_size} bytes, {size} were written"
        if file.suffix == ".safetensors" and (why := safetensors_problem(file)) is not None:
            return f"{rel}: {why}"
    return None


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
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / RECORD).write_text(json.dumps({"step": step, "config": to_dict(cfg), "files": files}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        with atomic_file(root / LATEST) as pointer:
            pointer.write_text(final.name)
        # Rotate by step number among the checkpoints before this one: the one just written is
        # never deleted, and those after it (a future a resumed run is rewriting) are left alone.
        earlier = sorted((s, p) for p in root.glob("step-*") if p.is_dir() and (s := _step_of(p)) is not None
                         and s < step)
        for _, old in earlier[: max(0, len(earlier) - (cfg.keep_checkpoints - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, module: nn.Module, path: Path) -> int:
    """Restore what :func:`save_checkpoint` wrote into the prepared objects; returns its step."""
    try:
        if accelerator.distributed_type.name == "DEEPSPEED":
            accelerator.load_state(str(path))
        else:
            _check_trainable(accelerator, module, path)
            accelerator.load_state(str(path), strict=False)  # frozen weights are not in it (trainable_only)
    except MedusaError:
        raise
    except Exception as err:  # noqa: BLE001 - torch.load's and safetensors' many errors for a damaged file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise MedusaError(f"checkpoint {path} cannot be read ({type(err).__name__}: {first}): delete it and resume "
                          "from the previous one (or train again without --resume)") from None
    return int(json.loads((path / RECORD).read_text())["step"])


def _check_trainable(accelerator: Any, module: nn.Module, path: Path) -> None:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as saved:
        # save_state wrote the unwrapped module's names (no DDP "module." prefix)
        trainable = {n for n, p in accelerator.unwrap_model(module).named_parameters() if p.requires_grad}
        missing = trainable - set(saved.keys())
    if missing:
        raise MedusaError(f"checkpoint {path} does not match this run (missing {sorted(missing)[:3]}): "
                          "resume with the config that wrote it")
