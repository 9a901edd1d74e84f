"""The bench's mode names: the registered runners (``MODES``) and the engine modes' grammar,
``BASE[@KIND][+lookahead][+compile][:KERNELS]`` (``hybrid@eagle+compile``, ``'hybrid:gemv>3'``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from medusa.api import SHIPPED
from medusa.bench.runners import MODES
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.factory import MODES as ENGINE_MODES
from medusa.errors import MedusaError
from medusa.models import kinds
from medusa.runtime.kernels import split_kernels

COMPILED = "+compile"  # mode suffix: the engine mode with a compiled pass, beside the eager one in the same run
HEAD_KINDS = kinds.KINDS  # mode suffix @KIND: the engine mode on heads of that kind
UNSHIPPED = tuple(k for k in HEAD_KINDS if k not in SHIPPED)  # kinds no heads ship for: their modes need --heads or --KIND-heads
JACOBI = "+lookahead"  # mode hybrid's suffix: its pass also runs lookahead's window and pool n-grams
_SPEC = re.compile(rf"^(?P<base>[a-z0-9]+)(?:@(?P<kind>{'|'.join(HEAD_KINDS)}))?(?P<jacobi>\{JACOBI})?"
                   rf"(?P<compiled>\{COMPILED})?(?::(?P<kernels>[a-z0-9>]+))?$")


@dataclass(frozen=True)
class ModeSpec:
    """An engine mode as the bench names it: ``BASE[@KIND][+lookahead][+compile][:KERNELS]``."""

    base: str  # the engine's mode (medusa, eagle, hybrid, ...)
    kind: str | None  # heads kind it runs on (None: the heads --heads loaded)
    compiled: bool
    lookahead: bool = False  # hybrid only: with lookahead's window and pool (ProposerConfig.hybrid_lookahead)
    kernels: str | None = None  # linear kernels other than the plan's pick (medusa.runtime.kernels.split_kernels)


def mode_spec(name: str) -> ModeSpec | None:
    """The engine mode ``name`` names (None: not an engine mode). ``medusa`` and ``eagle`` run
    heads of their own kind; other modes the loaded heads unless ``@KIND`` says which."""
    found = _SPEC.match(name)
    if found is None or found["base"] not in ENGINE_MODES or (found["jacobi"] and found["base"] != "hybrid"):
        return None
    if found["kernels"] is not None:
        try:
            split_kernels(found["kernels"])
        except ValueError:
            return None
    kind = found["kind"] or (found["base"] if found["base"] in HEAD_KINDS else None)
    return ModeSpec(found["base"], kind, bool(found["compiled"]), bool(found["jacobi"]), found["kernels"])


def runs_lookahead(modes: list[str]) -> bool:
    """Whether a mode of the run runs lookahead's window (mode lookahead, or hybrid+lookahead)."""
    return any(m == "lookahead" or JACOBI in m for m in modes)


def known_mode(name: str) -> bool:
    return name in MODES or mode_spec(name) is not None


def parse_modes(text: str | None, engine: Engine | None = None) -> list[str]:
    """The modes asked for (default: hf, baseline and ``engine``'s default mode), all known."""
    names = [m.strip() for m in (text or f"hf,baseline,{engine.default_mode}").split(",") if m.strip()]
    modes = list(dict.fromkeys(names))
    unknown = [m for m in modes if not known_mode(m)]
    if unknown:
        raise MedusaError(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}, "
                          f"{', '.join(ENGINE_MODES)} (an engine mode with @KIND, {', '.join(HEAD_KINDS)}, runs those heads, "
                          f"with {COMPILED} compiled)")
    return modes
