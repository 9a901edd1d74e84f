"""Typed run configs: a dataclass is the schema, YAML holds what differs, flags override.

Every field of a config dataclass is declared with :func:`arg`, which records its help text.
:func:`parse_config` then reads ``--config FILE.yaml`` (only the keys that differ from the
defaults), applies ``--field value`` overrides on top (as ``HfArgumentParser`` does), and
returns a checked instance. Entry points reuse it for any config class::

    cfg = parse_config(TrainConfig, sys.argv[1:])
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml

from medusa.errors import MedusaError

T = TypeVar("T")


def arg(default: Any, help: str, choices: tuple[Any, ...] | None = None,
        bounds: tuple[float | None, float | None] | None = None) -> Any:
    """A config field with its help text (and allowed values: ``choices``, or inclusive
    ``bounds`` ``(low, high)``, either None for open) kept next to the default."""
    meta = {"help": help, "choices": choices, "bounds": bounds}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def count(low: int = 1) -> Callable[[str], int]:
    """An argparse ``type`` for an integer flag of at least ``low``: ``--limit 0`` is a usage
    error naming the flag, not a run that means something else."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def temperatures_arg(text: str) -> list[float]:
    """An argparse ``type`` for comma-separated sampling temperatures in (0, 2] (``none``: [])."""
    if text.strip().lower() == "none":
        return []
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of temperatures, e.g. 0.7,1.0") from None
    if any(not 0 < t <= 2 for t in values):
        raise argparse.ArgumentTypeError(f"temperatures must be in (0, 2], got {text!r}")
    return values


def writable_folder(folder: Path, flag: str) -> None:
    """Create ``folder`` now, or say in one line why ``flag`` cannot be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise MedusaError(f"{flag}: cannot create {folder}: {err.strerror}; pass a writable path") from None
    if not os.access(folder, os.W_OK):
        raise MedusaError(f"{flag}: {folder} is not writable; pass a writable path")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Check and convert one value (from YAML or a flag) to the field's declared type."""
    base, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise MedusaError(f"config field {name} may not be empty: give it a value")
    try:
        if base is bool:
            return value if isinstance(value, bool) else _parse_bool(str(value))
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if base is float:
            return float(value)
        if base is str:
            return str(value)
        if typing.get_origin(base) is list:
            (item,) = typing.get_args(base)
            items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
            return [_coerce(name, item, v.strip() if isinstance(v, str) else v) for v in items]
        if typing.get_origin(base) is dict or base is dict:
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
    except (TypeError, ValueError):
        raise MedusaError(f"config field {name} expects {getattr(base, '__name__', base)}, got {value!r}") from None
    raise MedusaError(f"config field {name} has an unsupported type {tp}")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise MedusaError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
        if not text.strip():  # a config cut to nothing would otherwise train with every default
            raise MedusaError(f"{path} is empty: write the fields that differ from the defaults into it, "
                              "or drop --config")
        data = yaml.safe_load(text) or {}
    except UnicodeDecodeError:
        raise MedusaError(f"{path} is not a text file (a YAML config): pass the training config YAML") from None
    except yaml.YAMLError as err:
        raise MedusaError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise MedusaError(f"{path} must hold a mapping of field: value")
    return data


def from_dict(cls: type[T], data: dict[str, Any], source: str = "config") -> T:
    """Build ``cls`` from a mapping, rejecting unknown keys (typos never pass silently)."""
    types_ = _field_types(cls)
    data = dict(data)
    for old, new in RENAMED.items():
        if old in data and old not in types_ and new in types_:
            if new in data:
                raise MedusaError(f"{source}: {old} is the old name of {new}: set only {new}")
            logging.getLogger("medusa.config").warning("%s: %s is now called %s (read as %s=%s)", source, old, new,
                                                       new, data[old])
            data[new] = data.pop(old)
    for old, why in REMOVED.items():
        if old in data and old not in types_:
            raise MedusaError(f"{source}: {old} was removed ({why}): delete it from the config")
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise MedusaError(f"{source}: unknown field(s) {', '.join(unknown)} for {cls.__name__}: see --help for the fields")
    values = {k: _coerce(k, types_[k], v) for k, v in data.items()}
    for f in dataclasses.fields(cls):
        if f.name in values:
            _check_allowed(f, values[f.name], source)
    return cls(**values)


def _check_allowed(f: dataclasses.Field, value: Any, source: str) -> None:
    choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
    if choices and value not in choices:
        raise MedusaError(f"{source}: {f.name}={value!r} is not one of {', '.join(map(str, choices))}")
    if bounds is None or value is None:
        return
    low, high = bounds
    if (low is not None and value < low) or (high is not None and value > high):
        want = (f"at least {low}" if high is None else f"at most {high}" if low is None
                else f"between {low} and {high}")
        raise MedusaError(f"{source}: {f.name}={value!r} must be {want}")


class HelpFormatter(argparse.HelpFormatter):
    """Every tool's help: a flag's default is shown unless its help already says it (or
    there is none to show: an unset value, an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "default" not in text and "%(default)" not in text
                and not any(action.default is unset for unset in (None, False, argparse.SUPPRESS))):
            text += " (default: %(default)s)"
        return text


def flag(name: str) -> str:
    """The command-line spelling of a config field: ``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + name.replace("_", "-")


def build_parser(cls: type, description: str | None = None, prog: str | None = None,
                 epilog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with ``--config`` and one ``--field-name`` flag per dataclass field.

    YAML keys keep the field names (``max_new_tokens``); flags spell them with dashes. The
    underscore spelling and a renamed field's old name still parse as hidden aliases."""
    parser = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip().splitlines()[0],
                                     epilog=epilog, formatter_class=HelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file with the fields that differ from the defaults "
                        "(keys are the field names, underscores: max_steps for --max-steps)")
    types_ = _field_types(cls)
    old_names = {new: old for old, new in RENAMED.items()}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        # `--flag` alone means true for a bool; `--flag false` also works.
        kw = dict(nargs="?", const="true") if _unwrap_optional(types_[f.name])[0] is bool else {}
        text = f.metadata.get("help", "")
        parser.add_argument(flag(f.name), dest=f.name, default=argparse.SUPPRESS, **kw,
                            help=text if "default" in text else f"{text} (default: {default})")
        hidden = {f"--{f.name}"} | ({flag(old_names[f.name]), f"--{old_names[f.name]}"} if f.name in old_names else set())
        for alias in sorted(hidden - {flag(f.name)}):
            parser.add_argument(alias, dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)
    return parser


def parse_config(cls: type[T], argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> T:
    """``--config FILE`` + ``--field-name value`` overrides -> a checked ``cls`` instance."""
    ns = vars((parser or build_parser(cls)).parse_args(argv))
    path = ns.pop("config", None)
    data = load_yaml(path) if path else {}
    data.update(ns)  # flags win over the YAML file
    return from_dict(cls, data, source=str(path) if path else "flags")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain, YAML/JSON-safe mapping of a config instance (for run records)."""
    return dataclasses.asdict(cfg)


def diff_from_defaults(cfg: Any) -> dict[str, Any]:
    """Only the fields that differ from the class defaults: what a YAML file would hold."""
    out = {}
    for f in dataclasses.fields(cfg):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        value = getattr(cfg, f.name)
        if value != default:
            out[f.name] = value
    return out


# -- entry points ------------------------------------------------------------------------------
@contextmanager
def log_above_progress_bars() -> Iterator[None]:
    """INFO logging with a time stamp, printed above tqdm's progress bars while the context
    is open (tqdm's own ``logging_redirect_tqdm``): the training entry points run inside it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    with logging_redirect_tqdm():
        yield


def run_main(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status; a ``MedusaError`` is one line on stderr and status 2."""
    try:
        sys.exit(main())
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


# -- training configs ----------------------------------------------------------------------------
# Heads and draft training share these field groups; a subclass changes a default with
# `override` (help text kept). They live here, not in medusa/training, so that reading a run
# record (the Hub model card) never imports the training stack.

def override(group: type, name: str, default: Any) -> Any:
    """The field ``name`` of ``group`` with another default (same help and choices)."""
    meta = group.__dataclass_fields__[name].metadata  # type: ignore[attr-defined]
    return arg(default, meta["help"], meta["choices"], meta.get("bounds"))


# Old field names still read from YAML files, with a warning naming the new one.
RENAMED = {"cache_topk": "teacher_topk", "output_dir": "output", "hub_model_id": "repo_id"}
# Old fields that are refused with the reason.
REMOVED = {"pack": "packed sequences let attention cross conversations, so heads trained on features they never "
                   "see at inference; every sequence is now its own row"}


@dataclasses.dataclass
class TargetFields:
    model: str | None = arg(None, "target: Hub id, local folder or .gguf file (empty: the embedded SmolLM2-135M-Instruct)")
    dtype: str | None = arg(None, "target dtype: float32 | bfloat16 | float16 (default: bf16 on cuda, fp32 on cpu)")
    trust_remote_code: bool = arg(False, "allow model code from the Hub")


@dataclasses.dataclass
class DataFields:
    data: list[str] = arg(["sharegpt"], "sources: 'sharegpt', .json/.jsonl files, Hub dataset ids (comma separated)")
    data_split: str = arg("train", "split of Hub datasets")
    max_samples: int | None = arg(None, "conversations taken from each source (shuffled with data_seed)", bounds=(1, None))
    max_length: int = arg(512, "tokens per sequence (longer ones are truncated)", bounds=(2, None))
    eval_fraction: float = arg(0.02, "fraction of each source held out for evaluation", bounds=(0, 0.5))
    data_seed: int = arg(0, "seed of the data shuffle and held-out split")
    chat_template: str | None = arg(None, "Jinja chat template (file or text) for tokenizers that have none")
    num_proc: int | None = arg(None, "processes that tokenise the data (datasets map; empty: 1 below 5,000 "
                                     "conversations per source, else min(8, cores))", bounds=(1, None))
    data_cache_dir: str | None = arg(None, "cache of the tokenised rows (Arrow files named by a hash of the "
                                           "conversations, tokenizer, chat template and max_length; empty: "
                                           "HF_DATASETS_CACHE/medusa-tokenised)")


@dataclasses.dataclass
class CacheFields:
    cache_dir: str | None = arg(None, "feature cache of the frozen target's hidden states and top-k next-token "
                                      "log-probabilities (built there when missing; heads and draft training with "
                                      "the same data settings share it): epochs then never run the target")
    teacher_topk: int = arg(32, "the target's top-k tokens kept as the distillation teacher (and in the cache)", bounds=(1, None))
    train_vocab: int = arg(0, "softmax over only the N most frequent tokens of the data while training (0: full "
                              "vocabulary); makes CPU training several times cheaper", bounds=(0, None))
    vocab_fill: list[str] | None = arg(None, "answer files (.jsonl(.gz) with messages) whose assistant text fills "
                                             "train_vocab's places after the data's own answer tokens, most frequent "
                                             "first: for data with fewer distinct tokens than train_vocab (eagle3's "
                                             "draft vocabulary; medusa and eagle heads' training softmax)")
    cache_batch_tokens: int = arg(4096, "tokens per target pass while building the cache", bounds=(1, None))
    cache_kernels: str = arg("default", "the frozen target's linear kernels while building the cache: default, or "
                                        "onednn (packed oneDNN weights on a CPU, medusa/runtime/kernels.py: 1.7-4x "
                                        "faster matmuls on an AMD EPYC; the features' last bits round differently)")


@dataclasses.dataclass
class OptimFields:
    batch_size: int = arg(4, "sequences per micro-batch per process", bounds=(1, None))
    grad_accum: int = arg(1, "micro-batches per optimizer step", bounds=(1, None))
    lr: float = arg(1e-3, "peak learning rate", bounds=(0, None))
    weight_decay: float = arg(0.0, "AdamW weight decay (matrices only)", bounds=(0, None))
    adam_beta2: float = arg(0.999, "AdamW beta2 (beta1 is 0.9)", bounds=(0, 1))
    schedule: str = arg("cosine", "learning-rate schedule after warmup (transformers.get_scheduler)",
                        choices=("cosine", "linear", "constant"))
    warmup_steps: int = arg(20, "linear warmup steps", bounds=(0, None))
    min_lr_ratio: float = arg(0.1, "final learning rate as a fraction of lr (cosine, linear)", bounds=(0, 1))
    max_grad_norm: float = arg(1.0, "gradient clipping norm (0: off)", bounds=(0, None))
    num_epochs: float = arg(1.0, "passes over the training data (when max_steps <= 0)")
    max_steps: int = arg(-1, "optimizer steps; > 0 overrides num_epochs")
    seed: int = arg(42, "seed of initialisation, data order and dropout")


@dataclasses.dataclass
class EvalFields:
    eval_every: int = arg(200, "evaluate on held-out data every N steps, and always before the first step and "
                               "after the last (0: only then)", bounds=(0, None))
    eval_batches: int = arg(20, "micro-batches per evaluation (0: all held-out data)", bounds=(0, None))
    log_every: int = arg(10, "log metrics every N steps", bounds=(1, None))


@dataclasses.dataclass
class RunFields:
    save_every: int = arg(500, "checkpoint every N steps (0: never)", bounds=(0, None))
    keep_checkpoints: int = arg(2, "checkpoints kept (older ones are deleted)", bounds=(1, None))
    resume: bool = arg(False, "continue from the latest checkpoint in the output folder's checkpoints/")
    overwrite: bool = arg(False, "start a new run in an output folder that holds an earlier run's checkpoints, "
                                 "deleting them (without it, or --resume, such a folder is refused)")
    max_minutes: float = arg(0.0, "stop after this many minutes of training (after at least one step) and save "
                                  "what there is (0: no limit)", bounds=(0, None))
    wandb: bool = arg(True, "log to Weights & Biases through accelerate (offline unless WANDB_MODE=online; "
                                "WANDB_MODE=disabled turns it off)")
    wandb_project: str = arg("medusa", "wandb project")
    run_name: str | None = arg(None, "run name for logs")


@dataclasses.dataclass
class TrainConfig(RunFields, EvalFields, OptimFields, CacheFields, DataFields, TargetFields):
    """Train Medusa heads (Medusa-1, or Medusa-2 with LoRA) or EAGLE heads (kind: eagle) on a Hugging Face causal LM."""

    # -- heads --
    kind: str = arg("medusa", "heads kind: medusa (independent heads), eagle (one autoregressive decoder layer "
                              "over the target's last features; needs cache_dir) or eagle3 (one layer over several "
                              "target layers fused, its own draft vocabulary of train_vocab tokens; the target runs "
                              "each step) or block (num_heads tokens drafted in one pass over the same fused layers)",
                  choices=("medusa", "eagle", "eagle3", "block"))
    num_heads: int = arg(4, "number of Medusa heads (head k predicts the token k+2 ahead); eagle: draft steps "
                            "unrolled in training (training-time test)", bounds=(1, None))
    num_layers: int = arg(1, "residual blocks per head; block: decoder layers (1 or 2)", bounds=(1, None))
    eagle_init: str = arg("last_layer", "eagle: how fresh heads start: last_layer (a copy of the target's last layer, "
                                        "fc takes the feature), last_layer_token (and adds the token's embedding at the "
                                        "feature's scale) or random", choices=("last_layer", "last_layer_token", "random"))
    eagle_layout: str = arg("norms", "eagle: norms (the layer's input norm and the target's final norm) or eagle1 "
                                     "(neither: vLLM's EAGLE-1 drafter, exportable with scripts/export_heads.py --to vllm)",
                            choices=("norms", "eagle1"))
    block_anchors: int = arg(16, "block: blocks (anchor positions) drawn per sequence per step", bounds=(1, None))
    block_decay: float = arg(4.0, "block: block position i's loss weight is exp(-i / block_decay)", bounds=(0, None))
    feature_layers: list[int] | None = arg(None, "eagle3, block: the target layers whose inputs are fused (default: vLLM's "
                                                 "2, the middle one and the third from last)")
    projection: str = arg("shared", "vocabulary projection: shared (the target's frozen lm_head) or per_head",
                          choices=("shared", "per_head"))
    init_heads: str | None = arg(None, "start from the heads in this folder (fine-tuning) instead of fresh ones; "
                                       "their num_heads/num_layers/projection/eagle_layout replace the settings above")
    # -- objective --
    distill: float = arg(1.0, "weight of self-distillation KL vs ground-truth CE: 1 = KL only, 0 = CE only")
    head_weight_decay: float = arg(0.8, "head k's loss weight is decay**k (unless head_weights is set)", bounds=(0, None))
    head_weights: list[float] | None = arg(None, "explicit per-head loss weights (comma separated)")
    feature_weight: float = arg(0.1, "eagle: weight of the feature regression next to the KL", bounds=(0, None))
    # -- Medusa-2 --
    lora: bool = arg(False, "Medusa-2: also train the target through LoRA adapters")
    lora_r: int = arg(16, "LoRA rank", bounds=(1, None))
    lora_alpha: int = arg(32, "LoRA alpha", bounds=(1, None))
    lora_dropout: float = arg(0.05, "LoRA dropout", bounds=(0, 1))
    lora_target_modules: list[str] = arg(["q_proj", "k_proj", "v_proj", "o_proj"], "modules that get LoRA adapters")
    lm_loss_weight: float = arg(1.0, "Medusa-2: weight of the KL keeping the tuned target close to the original", bounds=(0, None))
    lora_lr: float | None = arg(None, "learning rate of LoRA parameters (default: lr / 10)")
    # -- feature cache (Medusa-1) --
    positions_per_batch: int = arg(1024, "with a cache: token positions per micro-batch per process", bounds=(1, None))
    # -- output (checkpoints, logging: RunFields) --
    output: str = arg("out/heads", "where the trained heads folder is written")
    push_to_hub: bool = arg(False, "upload the heads to the Hugging Face Hub when training ends "
                                   "(token: `hf auth login` or HF_TOKEN, checked before training starts)")
    repo_id: str | None = arg(None, "Hub repository USER/NAME that push_to_hub uploads to")

    def output_path(self) -> Path:
        return Path(self.output)

    def __post_init__(self) -> None:
        if self.push_to_hub and not self.repo_id:
            raise MedusaError("push_to_hub needs repo_id (--repo-id): set it to the Hub repository USER/NAME")
        if self.lora and self.cache_dir:
            raise MedusaError("a feature cache needs a frozen target, but lora trains it: drop cache_dir or lora")
        if self.cache_kernels not in ("default", "onednn", "gemv"):
            raise MedusaError(f"unknown cache_kernels {self.cache_kernels!r}: use default, onednn or gemv")
        if not 0 <= self.distill <= 1:
            raise MedusaError(f"distill must be in [0, 1], got {self.distill}")
        if self.kind in ("eagle3", "block") and self.lora:
            raise MedusaError(f"{self.kind} heads read a frozen target's layers, but lora trains it: drop lora")
        if self.kind == "block" and (self.block_anchors < 1 or not self.block_decay > 0 or self.num_layers > 2):
            raise MedusaError(f"block heads need block_anchors >= 1, block_decay > 0 and num_layers 1 or 2, got "
                              f"{self.block_anchors}, {self.block_decay} and {self.num_layers}")
        if self.kind == "eagle" and (self.lora or not self.cache_dir):
            raise MedusaError("eagle heads train on the feature cache of a frozen target: set cache_dir and drop lora")
        if self.max_steps <= 0 and self.num_epochs <= 0:
            raise MedusaError("set max_steps or num_epochs to a positive number")
