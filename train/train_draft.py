"""Distil a draft model for ``mode="draft"`` (classic speculative decoding).

    python -m train.train_draft                      # the default draft of the embedded model
    accelerate launch train/train_draft.py --config configs/draft/smollm2-135m.yaml [--field-name value ...]

With no arguments the draft of the embedded SmolLM2-135M-Instruct is built from its first
layers, distilled on ShareGPT and saved where ``medusa.load(draft="default")`` finds it
(``~/.cache/medusa/models/SmolLM2-135M-Instruct-draft``). Every field, its default and its
meaning: ``python -m train.train_draft --help``. The loop (the one heads use too) lives in
``medusa/training/loop.py``, what is particular to a draft in ``medusa/training/draft_task.py``; this
file only parses the config and reports errors.
"""

from __future__ import annotations

import argparse
import logging

from medusa import config
from medusa.config import log_above_progress_bars, parse_config, run_main
from medusa.errors import require_extra
from medusa.training.draft_task import DraftTrainConfig
from medusa.training.loop import train


def build_parser() -> argparse.ArgumentParser:
    return config.build_parser(DraftTrainConfig, prog="train/train_draft.py", epilog=(
        "This trains a draft model (mode draft); Medusa and EAGLE heads train with train/train_heads.py "
        "(--kind medusa or eagle). Recipes: docs/training.md. YAML keys are the field names with "
        "underscores (max_steps for --max-steps)."))


def main(argv: list[str] | None = None) -> int:
    require_extra("train")  # first, so that even --help names the extra to install
    with log_above_progress_bars():
        cfg = parse_config(DraftTrainConfig, argv, build_parser())
        folder = train(cfg)
    logging.getLogger("medusa.training.draft_task").info("draft written to %s", folder)
    return 0


if __name__ == "__main__":
    run_main(main)
