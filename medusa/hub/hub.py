"""Heads on the Hugging Face Hub: resolve ``USER/NAME`` ids, load any heads layout, publish.

Loading (``medusa.load(heads=...)`` goes through :func:`load_heads_from`):

- a local folder in our layout (``config.json`` + ``model.safetensors``) or in
  FasterDecoding's Medusa-1 layout (see :mod:`medusa.hub.export`);
- a Hub id ``USER/NAME`` (``USER/NAME@REV``: pinned to a branch, tag or commit): fetched with
  ``huggingface_hub.snapshot_download`` into its usual cache (the top-level JSON and safetensors
  files only); ``HF_HUB_OFFLINE=1`` uses the cache alone.

Publishing builds a folder with exactly ``README.md`` (model card), ``config.json`` and
``model.safetensors`` and uploads it with ``HfApi.upload_folder``. The token comes from
``huggingface_hub.get_token()`` (``HF_TOKEN`` or the stored login) and never appears in a
message.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from medusa.errors import MedusaError
from medusa.hub.card import HUB_ID, card_base_model, model_card, public_record
from medusa.hub.fasterdecoding import FD_PICKLE, FD_WEIGHTS, is_fasterdecoding_folder, read_fasterdecoding
from medusa.models.heads import MedusaHeads
from medusa.models.heads_config import (
    CALIBRATION_NAME,
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadsConfig,
    read_heads_config,
)
from medusa.models.kinds import kind
from medusa.models.loader import apply_calibration, check_state, heads_from_state, read_folder
from medusa.models.target import hub_reference, no_such_folder
from medusa.runtime.files import read_json, refuse_foreign
from medusa.runtime.ngrams import NGRAMS_NAME, NgramTable

CARD_NAME = "README.md"
PUBLISH_FILES = (CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, CALIBRATION_NAME, NGRAMS_NAME)
# What a Hub download fetches: the top-level configs and safetensors, never pickles or anything
# runnable, and nothing in subfolders (a repository's checkpoints/, onnx/ or older versions).
# huggingface_hub matches these with fnmatch, whose "*" also matches "/": hence the ignore pattern.
HUB_PATTERNS = ["*.json", "*.safetensors"]
HUB_IGNORE = ["*/*"]


# -- resolving a heads argument ----------------------------------------------------------------
def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def fetch_from_hub(repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """The snapshot folder of ``repo_id`` in the Hugging Face cache (downloaded when online).

    Only JSON and safetensors files are fetched. A FasterDecoding repository that has no
    safetensors weights gets its ``medusa_lm_head.pt`` as well, which is then loaded as
    plain tensors only.
    """
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def download(patterns: list[str]) -> Path:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns,
                                      ignore_patterns=HUB_IGNORE))

    try:
        folder = download(HUB_PATTERNS)
        if is_fasterdecoding_folder(folder) and not (folder / FD_WEIGHTS).is_file():
            folder = download([FD_PICKLE])
    except GatedRepoError:
        raise MedusaError(f"Hub repository {repo_id} is gated: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise MedusaError(f"heads {repo_id!r} have no revision {revision!r} on the Hub: pass an existing branch, tag "
                          "or commit after @") from None
    except RepositoryNotFoundError:
        raise MedusaError(
            f"heads {repo_id!r}: no such local folder, and no such Hub repository (or it is private: log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        if is_offline_mode():
            raise MedusaError(
                f"heads {repo_id!r} are not a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE is set: "
                "download them once with network access (or pass a local heads folder)"
            ) from None
        raise MedusaError(
            f"heads {repo_id!r} are not a local folder, not in the Hugging Face cache, and the Hub cannot be reached: "
            "check the network or pass a local heads folder"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise MedusaError(f"cannot fetch heads {repo_id!r} from the Hugging Face Hub: {_first_line(err)}") from None
    return folder


def resolve_heads_folder(source: str | Path) -> Path:
    """A local folder as is; a Hub id (``USER/NAME``, or ``USER/NAME@REV`` pinned to a branch,
    tag or commit) through the Hugging Face cache; a path that is not there: one line."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    reference = None if path.exists() or not isinstance(source, str) else hub_reference(source)
    if reference is not None:
        return fetch_from_hub(*reference)
    raise MedusaError(
        f"heads not found: {source}: {no_such_folder(str(source))}; neither a heads folder nor a Hub id USER/NAME[@REVISION] "
        "(pass a folder written by train/train_heads.py, a Hub id, or 'init')"
    )


def read_heads(folder: str | Path, model: nn.Module | None = None) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """Config and state dict (our key names, stored dtypes) of a heads folder in any
    supported layout (published ones: :func:`medusa.models.loader.read_folder`, which may need
    the target ``model``), checked against the config."""
    folder = Path(folder)
    if is_fasterdecoding_folder(folder):
        config, state = read_fasterdecoding(folder)
    else:
        config, state = read_folder(folder, model)
    if not kind(config.kind).on_target:  # heads built on their target are checked against it when built
        with torch.device("meta"):
            check_state(config, MedusaHeads(config).state_dict(), state, folder)
    return config, state


def load_heads_from(source: str | Path, model: nn.Module | None = None, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> MedusaHeads:
    """Heads from a local folder (our layout or FasterDecoding's) or a Hub id."""
    folder = resolve_heads_folder(source)
    config, state = read_heads(folder, model)
    return apply_calibration(heads_from_state(config, state, model, device, dtype, where=folder), folder)


# -- publishing --------------------------------------------------------------------------------
def require_token(token: str | None = None) -> str:
    """The Hugging Face token (argument, ``HF_TOKEN`` or the stored login), or a one-line error."""
    if token:
        return token
    from huggingface_hub import get_token

    try:
        found = get_token()
    except Exception as err:  # an explicit OIDC setup that failed: say so, without details that may hold secrets
        raise MedusaError(f"could not obtain a Hugging Face token ({type(err).__name__}): run `hf auth login` or set HF_TOKEN") from None
    if not found:
        raise MedusaError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (or use --dry-run to only build the folder)")
    return found


def read_bench(path: str | Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    path = Path(path)
    if not path.is_file():
        raise MedusaError(f"benchmark file not found: {path} (write one with `python -m infer.bench --json FILE`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise MedusaError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, dict):
        raise MedusaError(f"{path} is not a benchmark result (expected a JSON object from `python -m infer.bench --json`)")
    return data


def build_publish_folder(heads_dir: str | Path, out: str | Path, repo_id: str, bench_json: str | Path | None = None,
                         base_model: str | None = None, license: str | None = None) -> Path:
    """Write ``README.md``, ``config.json``, ``model.safetensors`` and, when the heads have
    them, ``calibration.json`` (calibrated trees, draft vocabulary) and ``ngrams.safetensors``
    (mode hybrid's n-gram table) for ``repo_id`` into ``out``.

    Only these files are published, whatever else ``heads_dir`` holds (optimizer state,
    logs). Heads in FasterDecoding's layout are converted to ours.
    """
    if not HUB_ID.match(repo_id):
        raise MedusaError(f"--repo-id must look like USER/NAME, got {repo_id!r}")
    config, state = read_heads(heads_dir)
    bench = read_bench(bench_json)
    out = Path(out)
    refuse_foreign(out, PUBLISH_FILES, "output folder")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, out / WEIGHTS_NAME, metadata={"format": "pt"})
    public = dataclasses.replace(config, base_model=card_base_model(base_model or config.base_model),
                                 extra=public_record(config.extra))
    (out / CONFIG_NAME).write_text(json.dumps(public.to_dict(), indent=2, allow_nan=False) + "\n")
    calibration = None
    if (Path(heads_dir) / CALIBRATION_NAME).is_file():
        calibration = public_record(read_json(Path(heads_dir) / CALIBRATION_NAME, "run scripts/calibrate_tree.py "
                                              "again, or delete it (the heads work without it)"))
        (out / CALIBRATION_NAME).write_text(json.dumps(calibration, allow_nan=False) + "\n")
    else:
        (out / CALIBRATION_NAME).unlink(missing_ok=True)  # left from an earlier build
    if (Path(heads_dir) / NGRAMS_NAME).is_file():  # the n-gram table of the target's answers (mode hybrid)
        NgramTable.load(Path(heads_dir) / NGRAMS_NAME, config.vocab_size).save(out / NGRAMS_NAME)
    else:
        (out / NGRAMS_NAME).unlink(missing_ok=True)
    card = model_card(public, repo_id, bench=bench, license=license, calibration=calibration,
                      weights_bytes=(out / WEIGHTS_NAME).stat().st_size)
    (out / CARD_NAME).write_text(card)
    return out


def folder_listing(folder: str | Path) -> list[tuple[str, int]]:
    """``(name, bytes)`` of every file an upload of ``folder`` sends."""
    folder = Path(folder)
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file())


def upload(folder: str | Path, repo_id: str, token: str, private: bool = False, commit_message: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload ``folder``; returns the repository URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), token=token,
                          commit_message=commit_message or "Upload Medusa heads")
    except Exception as err:  # any failure of the upload: one line, with the token scrubbed out
        message = _first_line(err)
        detail = getattr(err, "server_message", None)  # the Hub's own reason ("Invalid username or password")
        if detail:
            message += f" ({' '.join(str(detail).split())})"
        raise MedusaError(f"upload to {repo_id} failed: {message.replace(token, '***')[:400]}") from None
    return str(url)


def push_heads(folder: str | Path, repo_id: str, private: bool = False, bench_json: str | Path | None = None,
               token: str | None = None, base_model: str | None = None, license: str | None = None) -> str:
    """Publish a heads folder to the Hub as ``repo_id``; returns the repository URL.

    The token is checked before anything is built. The upload folder is a temporary copy
    holding only the card, the config and the weights.
    """
    token = require_token(token)
    with tempfile.TemporaryDirectory(prefix="medusa-publish-") as tmp:
        staged = build_publish_folder(folder, Path(tmp) / "heads", repo_id, bench_json=bench_json,
                                      base_model=base_model, license=license)
        config = read_heads_config(staged)
        message = f"Upload Medusa heads ({config.num_heads} heads x {config.num_layers} layers)"
        return upload(staged, repo_id, token, private=private, commit_message=message)
