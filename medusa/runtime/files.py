"""Files on disk: where medusa caches what it derives (:func:`cache_root`), and atomic writes
of model folders and small files, the one helper every writer uses (heads, the embedded
target, draft models, vLLM exports, training records, feature caches).

A reader never sees half a folder: everything is written into a hidden sibling folder first
and swapped in only when the writer's block ends without an error. A failed writer leaves
the previous folder as it was and no temporary folder behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from medusa.errors import MedusaError


def cache_root() -> Path:
    """Where medusa caches derived artefacts; ``MEDUSA_CACHE`` overrides ``~/.cache/medusa``."""
    return Path(os.environ.get("MEDUSA_CACHE", Path.home() / ".cache" / "medusa"))


@contextmanager
def atomic_folder(folder: str | Path, keep_other_files: bool = False,
                  keep_folders: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``folder`` to write into; on success it replaces
    ``folder`` (the old one is renamed aside, then deleted).

    ``keep_other_files``: plain files of the old folder that the block did not write (a model
    card, eval records) are carried over into the new one. ``keep_folders``: these subfolders
    of the old folder (training checkpoints) are moved into the new one, after the swap.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        yield tmp
        if keep_other_files and folder.is_dir():
            for extra in folder.iterdir():
                if extra.is_file() and not (tmp / extra.name).exists():
                    shutil.copy2(extra, tmp / extra.name)
        old = folder.with_name(f".{folder.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.rename(folder, old)
        os.rename(tmp, folder)
        for name in keep_folders:
            if (old / name).is_dir() and not (folder / name).exists():
                os.rename(old / name, folder / name)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write; on success it replaces ``path`` in one rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def refuse_foreign(out: Path, allowed: Iterable[str], flag: str) -> None:
    """Raise unless ``out`` is absent or a folder holding only ``allowed`` file names: an
    earlier output may be replaced, never a folder holding anything else."""
    if not out.exists():
        return
    allowed = set(allowed)
    foreign = [p.name for p in out.iterdir() if p.name not in allowed] if out.is_dir() else [out.name]
    if foreign:
        raise MedusaError(f"{out} exists and holds {', '.join(sorted(foreign)[:3])}: choose an empty or new {flag}")
