"""Files on disk: where medusa caches what it derives (:func:`cache_root`), atomic writes
of model folders and small files, the one helper every writer uses (heads, the embedded
target, draft models, vLLM exports, training records, feature caches), and checked reads.

A file the user handed over (a heads folder, a model folder, a config) that is cut off, empty
or garbage is a one-line :class:`MedusaError` naming the file and the fix (:func:`read_json`,
:func:`read_tensors`, :func:`damaged_member`); a cache entry in the same state is dropped and
rebuilt with one warning line (:func:`drop_cache_entry`).

A reader never sees half a folder: everything is written into a hidden sibling folder first
and swapped in only when the writer's block ends without an error. A failed writer leaves
the previous folder as it was and no temporary folder behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from medusa.errors import MedusaError

log = logging.getLogger("medusa.cache")


def cache_root() -> Path:
    """Where medusa caches derived artefacts; ``MEDUSA_CACHE`` overrides ``~/.cache/medusa``."""
    return Path(os.environ.get("MEDUSA_CACHE", Path.home() / ".cache" / "medusa"))


_UNWRITABLE: set[str] = set()


def cache_write_failed(path: str | Path, err: OSError) -> None:
    """Say once per process and cache folder that a cache file could not be written (a
    read-only or full disk, a lock path taken by a folder); the caller goes on without it:
    a cache that cannot be written costs a measurement or a conversion again, never a load."""
    where = str(Path(path).parent)
    if where not in _UNWRITABLE:
        _UNWRITABLE.add(where)
        log.warning("medusa: cannot write the cache %s (%s: %s); going on without caching it (set MEDUSA_CACHE "
                    "to a writable folder)", path, type(err).__name__, err.strerror or err)


def content_digest(path: str | Path, root: str | Path | None = None) -> str:
    """The sha256 of the whole file ``path`` (hex), the key of caches derived from its content.

    Hashing reads the whole file (seconds for a model's weights), so the digest is remembered under ``root/digests/``
    (default ``cache_root()``) with the file's size, mtime, ctime and inode: while none of
    them changes (``cp -p`` keeps the mtime but not the ctime or inode) a later call costs a stat.
    """
    path = Path(path).resolve()
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    memo = Path(root if root is not None else cache_root()) / "digests" / \
        f"{hashlib.sha256(str(path).encode()).hexdigest()[:24]}.json"
    try:
        saved = json.loads(memo.read_bytes())
        if saved["path"] == str(path) and saved["stamp"] == stamp and len(saved["sha256"]) == 64:
            return saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no memo yet, or a damaged one: hashed again and rewritten
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(memo) as tmp:
            tmp.write_text(json.dumps({"path": str(path), "stamp": stamp, "sha256": hexdigest}))
    except OSError as err:
        cache_write_failed(memo, err)
    return hexdigest


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
    # a name of its own, so that two processes writing the same file never write into one temporary
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
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


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:160]


def read_json(path: str | Path, fix: str) -> dict:
    """The JSON object in ``path``; a missing, unreadable, cut-off, garbage or non-object file
    is a one-line :class:`MedusaError` naming it, then ``fix`` (what the user should do)."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise MedusaError(f"{path} is missing: {fix}") from None
    except OSError as err:
        raise MedusaError(f"cannot read {path} ({err.strerror}): {fix}") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError: cut off, empty or garbage
        raise MedusaError(f"{path} is damaged (not JSON: {_first_line(err)}): {fix}") from None
    if not isinstance(data, dict):
        raise MedusaError(f"{path} is damaged (a JSON {type(data).__name__}, not an object): {fix}")
    return data


def safetensors_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (missing, cut off, garbage), else None.
    Reads only its header: the check costs no more than opening it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            return None
    except FileNotFoundError:
        return "missing"
    except (SafetensorError, OSError, ValueError) as err:  # safetensors checks the header covers the file
        return _first_line(err)


def read_tensors(path: str | Path, fix: str) -> dict:
    """``{name: tensor}`` of the safetensors file ``path``, or a one-line :class:`MedusaError`
    naming it when it is missing, cut off or garbage, then ``fix``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    problem = safetensors_problem(path)
    if problem is None:
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            problem = _first_line(err)
    raise MedusaError(f"{path} is missing: {fix}" if problem == "missing" else f"{path} is damaged ({problem}): {fix}")


def damaged_member(folder: str | Path) -> tuple[Path, str] | None:
    """The first file of a model folder that is cut off or garbage, and why: every ``*.json``
    must parse and every ``*.safetensors`` must have a whole header and cover its data."""
    folder = Path(folder)
    for path in sorted(folder.glob("*.json")):
        try:
            json.loads(path.read_bytes())
        except (OSError, ValueError) as err:
            return path, f"not JSON: {_first_line(err)}"
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            return path, problem
    return None


def drop_cache_entry(path: str | Path, why: str) -> None:
    """Delete the damaged cache entry ``path`` (a file or a folder), saying so in one warning
    line; its caller then builds it again. Deleting a cache entry is always safe."""
    path = Path(path)
    log.warning("medusa: the cached %s is %s; rebuilding it", path, why)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
