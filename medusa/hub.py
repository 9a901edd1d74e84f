"""Heads on the Hugging Face Hub: resolve ``USER/NAME`` ids, load any heads layout, publish.

Loading (``medusa.load(heads=...)`` goes through :func:`load_heads_from`):

- a local folder in our layout (``config.json`` + ``model.safetensors``) or in
  FasterDecoding's Medusa-1 layout (see :mod:`medusa.export`);
- a Hub id ``USER/NAME``: fetched with ``huggingface_hub.snapshot_download`` into its usual
  cache (JSON and safetensors files only); ``HF_HUB_OFFLINE=1`` uses the cache alone.

Publishing builds a folder with exactly ``README.md`` (model card), ``config.json`` and
``model.safetensors`` and uploads it with ``HfApi.upload_folder``. The token comes from
``huggingface_hub.get_token()`` (``HF_TOKEN`` or the stored login) and never appears in a
message.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from medusa.errors import MedusaError
from medusa.export import FD_PICKLE, FD_WEIGHTS, is_fasterdecoding_folder, read_fasterdecoding
from medusa.heads import (
    CALIBRATION_NAME,
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadsConfig,
    MedusaHeads,
    apply_calibration,
    read_heads_config,
)
from medusa.target import DEFAULT_MODEL_ID, DEFAULT_MODEL_NAME, cache_root

CARD_NAME = "README.md"
PUBLISH_FILES = (CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, CALIBRATION_NAME)
# What a Hub download fetches: configs and safetensors, never pickles or anything runnable.
HUB_PATTERNS = ["*.json", "*.safetensors"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# -- resolving a heads argument ----------------------------------------------------------------
def is_hub_id(source: str) -> bool:
    """``USER/NAME`` with Hub-legal characters, and not an existing local path."""
    return bool(_HUB_ID.match(source)) and not Path(source).expanduser().exists() and ".." not in source


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
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    def download(patterns: list[str]) -> Path:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns))

    try:
        folder = download(HUB_PATTERNS)
        if is_fasterdecoding_folder(folder) and not (folder / FD_WEIGHTS).is_file():
            folder = download([FD_PICKLE])
    except GatedRepoError:
        raise MedusaError(f"Hub repository {repo_id} is gated: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)") from None
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
    """A local folder as is; a Hub id through the Hugging Face cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if isinstance(source, str) and is_hub_id(source):
        return fetch_from_hub(source)
    raise MedusaError(
        f"heads not found: {source} is neither a heads folder nor a Hub id USER/NAME "
        "(pass a folder written by train/train_heads.py, a Hub id, or 'init')"
    )


def read_heads(folder: str | Path) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """Config and state dict (our key names, stored dtypes) of a heads folder in any
    supported layout, checked against the config."""
    folder = Path(folder)
    if is_fasterdecoding_folder(folder):
        config, state = read_fasterdecoding(folder)
    else:
        config = read_heads_config(folder)
        weights = folder / WEIGHTS_NAME
        if not weights.is_file():
            raise MedusaError(f"{folder} has no {WEIGHTS_NAME}: pass a complete heads folder")
        state = load_file(weights)
    check_state(config, state, folder)
    return config, state


def check_state(config: HeadsConfig, state: dict[str, torch.Tensor], where: str | Path) -> None:
    """Raise unless ``state`` has exactly the tensors (names and shapes) ``config`` implies."""
    with torch.device("meta"):  # shapes only: no memory for per-head [V, H] projections
        expected = {k: tuple(v.shape) for k, v in MedusaHeads(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise MedusaError(f"{where} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    wrong = [k for k, shape in expected.items() if tuple(state[k].shape) != shape]
    if wrong:
        k = wrong[0]
        raise MedusaError(f"{where}: {k} has shape {tuple(state[k].shape)}, its config implies {expected[k]}")


def heads_from_state(config: HeadsConfig, state: dict[str, torch.Tensor], model: nn.Module | None = None,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MedusaHeads:
    """Build heads from a checked state dict and, when ``model`` is given, bind them to it."""
    lm_head = model.get_output_embeddings() if model is not None else None
    heads = MedusaHeads(config)
    if lm_head is not None:
        heads.bind(lm_head)  # raises a MedusaError when the heads were made for another model
        device = device or lm_head.weight.device
        dtype = dtype or lm_head.weight.dtype
    heads.load_state_dict(state, strict=True)
    return heads.to(device=device, dtype=dtype)


def load_heads_from(source: str | Path, model: nn.Module | None = None, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> MedusaHeads:
    """Heads from a local folder (our layout or FasterDecoding's) or a Hub id."""
    folder = resolve_heads_folder(source)
    config, state = read_heads(folder)
    return apply_calibration(heads_from_state(config, state, model, device, dtype), folder)


# -- model card --------------------------------------------------------------------------------
def card_base_model(base_model: str | None) -> str | None:
    """The base model as a Hub id where one is known; local paths reduce to their folder name
    (a card must not leak someone's home directory)."""
    if not base_model:
        return None
    path = Path(base_model).expanduser()
    embedded = path == cache_root() / "models" / DEFAULT_MODEL_NAME or (path.is_absolute() and path.name == DEFAULT_MODEL_NAME)
    if base_model == DEFAULT_MODEL_ID or embedded:
        return DEFAULT_MODEL_ID
    if path.is_absolute() or base_model.startswith((".", "~")) or path.exists():
        return path.name
    return base_model


def _public_name(value: Any) -> str:
    """A value for a public card: local paths reduce to their last component, also inside
    a command line (``--heads /home/me/out/heads`` -> ``--heads heads``)."""
    text = str(value)
    if " " in text:
        return " ".join(_public_name(word) for word in text.split(" "))
    if "=" in text and not text.startswith(("/", "~", ".")):
        key, _, rest = text.partition("=")
        return f"{key}={_public_name(rest)}" if rest.startswith(("/", "~", ".")) else text
    path = Path(text).expanduser()
    return path.name if path.is_absolute() or text.startswith((".", "~")) else text


def public_record(value: Any) -> Any:
    """``value`` (a config's ``extra``, a calibration record) fit for publishing: local paths
    reduce to their last component and NaN becomes null (strict JSON)."""
    if isinstance(value, dict):
        return {k: public_record(v) for k, v in value.items()}
    if isinstance(value, list):
        return [public_record(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, str):
        return _public_name(value)
    return value


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def head_accuracy(extra: dict[str, Any]) -> dict[str, list[float | None]]:
    """Per-head accuracy columns from a heads config's ``extra``: ``{"top1": [head1, head2, ...]}``.

    Reads ``eval_accuracy`` as ``train/train_heads.py`` writes it (``{"head1": {"top1": .6,
    "top5": .8}, ...}``), or ``per_head_accuracy`` as a list of top-1 values or of per-head
    dicts. Missing or NaN values become ``None``.
    """
    value = extra.get("eval_accuracy", extra.get("per_head_accuracy"))
    if isinstance(value, dict):  # {"head1": {...}, "head2": {...}}: order by head number
        keys = sorted(value, key=lambda k: int(re.sub(r"\D", "", str(k)) or 0))
        value = [value[k] for k in keys]
    if not isinstance(value, list) or not value:
        return {}
    if all(_number(v) is not None for v in value):
        value = [{"top1": v} for v in value]
    if not all(isinstance(v, dict) for v in value):
        return {}
    columns = [k for k in value[0] if any(_number(v.get(k)) is not None for v in value)]
    clean = lambda x: x if x is not None and x == x else None  # noqa: E731 (NaN -> None)
    return {str(c): [clean(_number(v.get(c))) for v in value] for c in columns}


def bench_results(bench: dict[str, Any] | None) -> dict[str, Any]:
    """tau, speedup and tokens/s of the ``medusa`` mode in an ``infer.bench --json`` file."""
    if not bench:
        return {}
    modes = bench.get("modes") if isinstance(bench.get("modes"), dict) else {}
    medusa = modes.get("medusa") if isinstance(modes.get("medusa"), dict) else {}
    out: dict[str, Any] = {k: _number(medusa.get(k)) for k in ("tau", "speedup", "tokens_per_second")
                           if _number(medusa.get(k)) is not None}
    hf = modes.get("hf") if isinstance(modes.get("hf"), dict) else {}
    if _number(hf.get("tokens_per_second")) is not None:
        out["reference_tokens_per_second"] = _number(hf["tokens_per_second"])
    meta = bench.get("meta") if isinstance(bench.get("meta"), dict) else {}
    setup = {k: _public_name(meta[k]) for k in ("device", "dtype", "prompts", "max_new_tokens") if k in meta}
    if isinstance(medusa.get("prompts"), int):
        setup["n_prompts"] = medusa["prompts"]
    out["setup"] = setup
    return out


def _flag_value(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(_public_name(v) for v in value)
    if value is None:
        return "none"
    return _public_name(value).lower() if isinstance(value, bool) else _public_name(value)


def training_command(extra: dict[str, Any]) -> str | None:
    """The ``train/train_heads.py`` command that reproduces the run recorded in ``extra``:
    its ``training_args`` as flags, for the fields that differ from the defaults (folders
    that only matter on the machine that trained, like output_dir, are left out)."""
    args = extra.get("training_args")
    if not isinstance(args, dict):
        return None
    from medusa.training import TrainConfig

    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                for f in dataclasses.fields(TrainConfig)}
    local_only = {"output_dir", "cache_dir", "resume", "wandb", "wandb_project", "run_name", "push_to_hub", "hub_model_id"}
    parts = ["accelerate", "launch", "train/train_heads.py"]
    for name, value in args.items():
        if name in defaults and name not in local_only and value != defaults[name]:
            parts += [f"--{name}", _flag_value(value)]
    return shlex.join(parts)


def training_data(extra: dict[str, Any]) -> list[str]:
    data = extra.get("training_args", {}).get("data") if isinstance(extra.get("training_args"), dict) else None
    if data is None:
        return []
    return [_public_name(d) for d in (data if isinstance(data, list) else [data])]


def calibration_lines(calibration: dict[str, Any] | None) -> list[str]:
    """Card lines for ``calibration.json``: the tree chosen per device and the draft vocabulary."""
    if not calibration or not isinstance(calibration.get("trees"), dict) or not calibration["trees"]:
        return []
    lines = ["", "Calibrated decoding trees (`calibration.json`, applied by `medusa.load` on the matching device):", ""]
    measured = calibration.get("measured", {}) if isinstance(calibration.get("measured"), dict) else {}
    for device, paths in calibration["trees"].items():
        m = measured.get(device, {}) if isinstance(measured.get(device), dict) else {}
        expected = _number(m.get("expected_tokens_per_pass"))
        detail = f", expected {expected:.2f} tokens per pass on held-out answers" if expected is not None else ""
        lines.append(f"- {device}: {len(paths)} candidates{detail}")
    vocab = calibration.get("draft_vocab")
    if isinstance(vocab, list) and vocab:
        coverage = _number(calibration.get("draft_vocab_coverage"))
        covers = f", covering {coverage:.1%} of held-out answer tokens" if coverage is not None else ""
        lines.append(f"- draft vocabulary: {len(vocab)} tokens{covers}")
    return lines


def model_card(config: HeadsConfig, repo_id: str, bench: dict[str, Any] | None = None, base_model: str | None = None,
               license: str | None = None, weights_bytes: int | None = None,
               calibration: dict[str, Any] | None = None) -> str:
    """The README.md of a heads repository: YAML front matter, what the heads are, how they
    were trained and measured, and how to use them here and with vLLM."""
    extra = config.extra or {}
    base = card_base_model(base_model or config.base_model)
    base_is_id = bool(base and _HUB_ID.match(base))
    data = training_data(extra)
    command = training_command(extra)
    accuracy = head_accuracy(extra)
    results = bench_results(bench)

    meta: dict[str, Any] = {}
    if base_is_id:
        meta["base_model"] = base
    if license:
        meta["license"] = license
    if any(_HUB_ID.match(d) for d in data):
        meta["datasets"] = [d for d in data if _HUB_ID.match(d)]
    meta["tags"] = ["medusa", "medusa-heads", "speculative-decoding"]
    front = yaml.safe_dump(meta, sort_keys=False).strip()

    name = repo_id.split("/")[-1]
    params = config.num_heads * config.num_layers * (config.hidden_size ** 2 + config.hidden_size)
    if config.projection == "per_head":
        params += config.num_heads * config.vocab_size * config.hidden_size
    lines = [f"---\n{front}\n---", "", f"# {name}", ""]
    lines.append(
        f"Medusa decoding heads for **{base or 'an unnamed base model'}**: {config.num_heads} heads that each "
        f"predict one more token ahead from the base model's last hidden state, so one forward pass of the base "
        f"model can verify several tokens (speculative decoding with tree attention). Greedy output is the base "
        f"model's own greedy output, token for token."
    )
    lines += ["", "| | |", "|---|---|"]
    lines.append(f"| heads | {config.num_heads} |")
    lines.append(f"| residual blocks per head | {config.num_layers} |")
    proj = ("shared: the base model's own `lm_head` (not stored here)" if config.projection == "shared"
            else "a trained copy of `lm_head` per head")
    lines.append(f"| vocabulary projection | {proj} |")
    lines.append(f"| hidden size / vocabulary | {config.hidden_size} / {config.vocab_size} |")
    lines.append(f"| trained parameters | {params / 1e6:.2f} M |")
    if weights_bytes is not None:
        size = f"{weights_bytes / 2**20:.1f} MiB" if weights_bytes >= 2**20 else f"{weights_bytes / 2**10:.0f} KiB"
        lines.append(f"| weights file | {size} (`{WEIGHTS_NAME}`) |")

    lines += ["", "## Training", ""]
    medusa2 = "medusa2" in extra
    frozen = "tuned with LoRA (Medusa-2)" if medusa2 else "frozen"
    lines.append(f"- Base model ({frozen}): {f'[{base}](https://huggingface.co/{base})' if base_is_id else (base or 'not recorded')}")
    if medusa2:
        lines.append("- These heads were trained together with a LoRA-tuned base model, which this repository does "
                     "not hold: they are meant for that tuned model.")
    lines.append(f"- Data: {', '.join(data) if data else 'not recorded'}")
    if isinstance(extra.get("steps"), int):
        hours = f" ({extra['train_seconds'] / 3600:.1f} h)" if _number(extra.get("train_seconds")) is not None else ""
        lines.append(f"- Optimizer steps: {extra['steps']}{hours}")
    if command:
        lines += ["- Command:", "", "```bash", command, "```"]
    else:
        lines.append("- Command: not recorded")

    lines += ["", "## Evaluation", ""]
    if accuracy:
        cols = list(accuracy)
        reference = extra.get("accuracy_reference")
        if reference:
            lines += [f"Held-out accuracy of each head against the {reference}:", ""]
        lines.append("| head | predicts | " + " | ".join(f"{c} accuracy" for c in cols) + " |")
        lines.append("|---|---|" + "---|" * len(cols))
        for k in range(max(len(v) for v in accuracy.values())):
            cells = [f"{accuracy[c][k]:.3f}" if k < len(accuracy[c]) and accuracy[c][k] is not None else "-" for c in cols]
            lines.append(f"| {k + 1} | token t+{k + 2} | " + " | ".join(cells) + " |")
    else:
        lines.append("Per-head accuracy: not recorded.")
    lines.append("")
    if "tau" in results or "speedup" in results:
        setup = results.get("setup", {})
        where = ", ".join(f"{k} {v}" for k, v in setup.items()) if setup else "setup not recorded"
        if "tau" in results:
            lines.append(f"- Mean tokens per base-model pass (tau): **{results['tau']:.2f}**")
        if "speedup" in results:
            lines.append(f"- Speedup over plain decoding (transformers `generate`): **{results['speedup']:.2f}x**")
        if "tokens_per_second" in results:
            ref = results.get("reference_tokens_per_second")
            ref_text = f" (plain: {ref:.1f})" if ref is not None else ""
            lines.append(f"- Tokens per second: {results['tokens_per_second']:.1f}{ref_text}")
        lines.append(f"- Measured with `python -m infer.bench` ({where}).")
    else:
        lines.append("Speed (tau, speedup): not measured.")
    lines += calibration_lines(calibration)

    model_arg = f'model="{base}", ' if base_is_id else 'model="BASE_MODEL", '
    lines += ["", "## Usage", "", "With this repository's `medusa` package:", "", "```python", "import medusa", "",
              f'engine = medusa.load({model_arg}heads="{repo_id}")',
              *([f'# or medusa.load(heads="{repo_id}"): the embedded copy of {base} these heads can be trained on']
                if base == DEFAULT_MODEL_ID else []),
              "result = engine.generate(prompt_ids, max_new_tokens=256)  # prompt_ids: list of token ids",
              "print(result.tokens, result.stats.tau)", "```", "",
              "With vLLM: export the heads to vLLM's Medusa layout, then serve the base model with them:", "",
              "```bash",
              f"python scripts/export_heads.py {repo_id} --to vllm --out {name}-vllm"
              + ("" if config.projection == "per_head" else f" --model {base if base_is_id else 'BASE_MODEL'}"),
              f"vllm serve {base if base_is_id else 'BASE_MODEL'} --speculative-config "
              f"'{{\"method\": \"medusa\", \"model\": \"{name}-vllm\", \"num_speculative_tokens\": {config.num_heads}}}'",
              "```", ""]
    if config.projection == "shared":
        lines += ["The export copies the base model's `lm_head` into every head, which vLLM's Medusa layout needs.", ""]
    return "\n".join(lines)


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
    one, ``calibration.json`` (calibrated trees, draft vocabulary) for ``repo_id`` into ``out``.

    Only these files are published, whatever else ``heads_dir`` holds (optimizer state,
    logs). Heads in FasterDecoding's layout are converted to ours.
    """
    if not _HUB_ID.match(repo_id):
        raise MedusaError(f"--repo-id must look like USER/NAME, got {repo_id!r}")
    config, state = read_heads(heads_dir)
    bench = read_bench(bench_json)
    out = Path(out)
    if out.exists():
        foreign = [p.name for p in out.iterdir() if p.name not in PUBLISH_FILES] if out.is_dir() else [out.name]
        if foreign:
            raise MedusaError(f"{out} exists and holds {', '.join(sorted(foreign)[:3])}: choose an empty or new output folder")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, out / WEIGHTS_NAME, metadata={"format": "pt"})
    public = dataclasses.replace(config, base_model=card_base_model(base_model or config.base_model),
                                 extra=public_record(config.extra))
    (out / CONFIG_NAME).write_text(json.dumps(public.to_dict(), indent=2, allow_nan=False) + "\n")
    calibration = None
    if (Path(heads_dir) / CALIBRATION_NAME).is_file():
        calibration = public_record(json.loads((Path(heads_dir) / CALIBRATION_NAME).read_text()))
        (out / CALIBRATION_NAME).write_text(json.dumps(calibration, allow_nan=False) + "\n")
    else:
        (out / CALIBRATION_NAME).unlink(missing_ok=True)  # left from an earlier build
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
