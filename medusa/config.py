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
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml

from medusa.errors import MedusaError

T = TypeVar("T")


def arg(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    """A config field with its help text (and allowed values) kept next to the default."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


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
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise MedusaError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise MedusaError(f"{path} must hold a mapping of field: value")
    return data


def from_dict(cls: type[T], data: dict[str, Any], source: str = "config") -> T:
    """Build ``cls`` from a mapping, rejecting unknown keys (typos never pass silently)."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise MedusaError(f"{source}: unknown field(s) {', '.join(unknown)} for {cls.__name__}: see --help for the fields")
    values = {k: _coerce(k, types_[k], v) for k, v in data.items()}
    for f in dataclasses.fields(cls):
        choices = f.metadata.get("choices")
        if choices and f.name in values and values[f.name] not in choices:
            raise MedusaError(f"{source}: {f.name}={values[f.name]!r} is not one of {', '.join(map(str, choices))}")
    return cls(**values)


def build_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with ``--config`` and one ``--field`` flag per dataclass field."""
    parser = argparse.ArgumentParser(description=description or (cls.__doc__ or "").strip().splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file with the fields that differ from the defaults")
    types_ = _field_types(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        base, _ = _unwrap_optional(types_[f.name])
        help_text = f.metadata.get("help", "")
        if base is bool:
            # `--flag` alone means true; `--flag false` also works.
            parser.add_argument(f"--{f.name}", nargs="?", const="true", default=argparse.SUPPRESS,
                                help=f"{help_text} (default: {default})")
        else:
            parser.add_argument(f"--{f.name}", default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
    return parser


def parse_config(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """``--config FILE`` + ``--field value`` overrides -> a checked ``cls`` instance."""
    parser = build_parser(cls, description)
    ns = vars(parser.parse_args(argv))
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
class TqdmHandler(logging.Handler):
    """Log lines printed above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def log_above_progress_bars() -> None:
    """INFO logging with a time stamp, written around tqdm bars (the training entry points)."""
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def run_main(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status; a ``MedusaError`` is one line on stderr and status 2."""
    try:
        sys.exit(main())
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
