"""Train Medusa heads for a causal LM.

    accelerate launch train/train_heads.py --config configs/train/smollm2-135m.yaml [--field value ...]

Every field, its default and its meaning: ``python train/train_heads.py --help``. The loop
lives in ``medusa/training.py``; this file only parses the config and reports errors.
"""

from __future__ import annotations

import logging
import sys

from medusa.config import parse_config
from medusa.errors import MedusaError
from medusa.training import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfg = parse_config(TrainConfig, argv)
    folder = train(cfg)
    logging.getLogger("medusa.training").info("heads written to %s", folder)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
