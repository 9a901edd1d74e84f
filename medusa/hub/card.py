"""The model card (README.md) of a heads repository: ``huggingface_hub.ModelCard`` rendered
from the template ``medusa/assets/model_card.md``, with YAML front matter from ``ModelCardData``.

Everything a card shows passes through here first: local paths reduce to their last component
(a card must not leak someone's home directory) and NaN accuracies show as ``-``.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from importlib.resources import files
from pathlib import Path
from typing import Any

from medusa.config import TrainConfig, flag
from medusa.models.heads_config import WEIGHTS_NAME, HeadsConfig
from medusa.models.target import DEFAULT_MODEL_ID, DEFAULT_MODEL_NAME
from medusa.runtime.files import cache_root

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    that only matter on the machine that trained, like output, are left out)."""
    args = extra.get("training_args")
    if not isinstance(args, dict):
        return None

    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                for f in dataclasses.fields(TrainConfig)}
    local_only = {"output", "cache_dir", "resume", "wandb", "wandb_project", "run_name", "push_to_hub", "repo_id"}
    parts = ["accelerate", "launch", "train/train_heads.py"]
    for name, value in args.items():
        if name in defaults and name not in local_only and value != defaults[name]:
            parts += [flag(name), _flag_value(value)]
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
    lines = []
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
    from huggingface_hub import ModelCard, ModelCardData

    extra = config.extra or {}
    base = card_base_model(base_model or config.base_model)
    base_is_id = bool(base and HUB_ID.match(base))
    data = training_data(extra)
    card_data = ModelCardData(base_model=base if base_is_id else None, license=license,
                              datasets=[d for d in data if HUB_ID.match(d)] or None,
                              tags=["medusa", "medusa-heads", "speculative-decoding"])
    params = config.num_heads * config.num_layers * (config.hidden_size ** 2 + config.hidden_size)
    if config.projection == "per_head":
        params += config.num_heads * config.vocab_size * config.hidden_size
    weights_size = None
    if weights_bytes is not None:
        weights_size = f"{weights_bytes / 2**20:.1f} MiB" if weights_bytes >= 2**20 else f"{weights_bytes / 2**10:.0f} KiB"
    accuracy = head_accuracy(extra)
    rows = [[f"{accuracy[c][k]:.3f}" if k < len(accuracy[c]) and accuracy[c][k] is not None else "-" for c in accuracy]
            for k in range(max((len(v) for v in accuracy.values()), default=0))]
    seconds = _number(extra.get("train_seconds"))
    template = files("medusa") / "assets" / "model_card.md"
    card = ModelCard.from_template(
        card_data, template_str=template.read_text(), config=config, repo_id=repo_id, name=repo_id.split("/")[-1],
        base=base, base_is_id=base_is_id, embedded=base == DEFAULT_MODEL_ID, params=params,
        weights_size=weights_size, weights_name=WEIGHTS_NAME, medusa2="medusa2" in extra, data=data,
        steps=extra["steps"] if isinstance(extra.get("steps"), int) else None,
        hours=None if seconds is None else seconds / 3600, command=training_command(extra),
        reference=extra.get("accuracy_reference"), accuracy_rows=rows,
        accuracy_header=" | ".join(f"{c} accuracy" for c in accuracy), accuracy_rule="---|" * len(accuracy),
        speed_lines=speed_lines(bench_results(bench)), calibration_lines=calibration_lines(calibration))
    return str(card)


def speed_lines(results: dict[str, Any]) -> list[str]:
    """Card lines for the measured speed (empty when nothing was measured)."""
    if "tau" not in results and "speedup" not in results:
        return []
    setup = results.get("setup", {})
    where = ", ".join(f"{k} {v}" for k, v in setup.items()) if setup else "setup not recorded"
    lines = []
    if "tau" in results:
        lines.append(f"- Mean tokens per base-model pass (tau): **{results['tau']:.2f}**")
    if "speedup" in results:
        lines.append(f"- Speedup over plain decoding (transformers `generate`): **{results['speedup']:.2f}x**")
    if "tokens_per_second" in results:
        ref = results.get("reference_tokens_per_second")
        ref_text = f" (plain: {ref:.1f})" if ref is not None else ""
        lines.append(f"- Tokens per second: {results['tokens_per_second']:.1f}{ref_text}")
    lines.append(f"- Measured with `python -m infer.bench` ({where}).")
    return lines
