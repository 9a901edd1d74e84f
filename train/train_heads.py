"""Train Medusa or EAGLE heads for a causal LM.

    accelerate launch train/train_heads.py --config configs/train/smollm2-135m.yaml [--field-name value ...]

``kind`` (``--kind medusa``, the default, ``--kind eagle`` or ``--kind eagle3``) picks the heads; docs/training.md
has the recipes. Every field, its default and its meaning: ``python train/train_heads.py --help``.
The loop lives in ``medusa/training/loop.py``; this file only parses the config and reports errors.
"""

from __future__ import annotations

import argparse
import logging

from medusa import config
from medusa.config import log_above_progress_bars, parse_config, run_main
from medusa.errors import MedusaError, require_extra
from medusa.hub.hub import push_heads, require_token
from medusa.training.loop import TrainConfig, train


def build_parser() -> argparse.ArgumentParser:
    return config.build_parser(TrainConfig, prog="train/train_heads.py", epilog=(
        "Both head kinds train here: --kind medusa (independent heads; Medusa-2 with --lora) or --kind eagle "
        "(one decoder layer over the target's features; needs --cache-dir) or --kind eagle3 (one layer over three target layers, "
        "its own draft vocabulary; the target runs each step). Recipes, data and configs: "
        "docs/training.md. YAML keys are the field names with underscores (max_steps for --max-steps)."))


def main(argv: list[str] | None = None) -> int:
    require_extra("train")  # first, so that even --help names the extra to install
    from accelerate import PartialState

    with log_above_progress_bars():
        cfg = parse_config(TrainConfig, argv, build_parser())
        if cfg.push_to_hub:
            require_token()  # a missing token shows now, not after the training run
        folder = train(cfg)
    log = logging.getLogger("medusa.training.loop")
    log.info("heads written to %s", folder)
    if cfg.push_to_hub and PartialState().is_main_process:
        try:
            url = push_heads(folder, cfg.repo_id)
        except MedusaError as err:
            raise MedusaError(f"{err} (the heads are saved in {folder}: publish them later with "
                              f"`python scripts/publish_heads.py {folder} --repo-id {cfg.repo_id}`)") from None
        log.info("heads published at %s", url)
    return 0


if __name__ == "__main__":
    run_main(main)
