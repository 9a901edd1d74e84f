"""Train Medusa heads for a causal LM.

    accelerate launch train/train_heads.py --config configs/train/smollm2-135m.yaml [--field value ...]

Every field, its default and its meaning: ``python train/train_heads.py --help``. The loop
lives in ``medusa/training.py``; this file only parses the config and reports errors.
"""

from __future__ import annotations

import logging
import sys

from accelerate import PartialState
from tqdm.auto import tqdm

from medusa.config import parse_config
from medusa.errors import MedusaError
from medusa.hub import push_heads, require_token
from medusa.training import TrainConfig, train


class TqdmHandler(logging.Handler):
    """Log lines printed above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    cfg = parse_config(TrainConfig, argv)
    if cfg.push_to_hub:
        require_token()  # a missing token shows now, not after the training run
    folder = train(cfg)
    log = logging.getLogger("medusa.training")
    log.info("heads written to %s", folder)
    if cfg.push_to_hub and PartialState().is_main_process:
        try:
            url = push_heads(folder, cfg.hub_model_id)
        except MedusaError as err:
            raise MedusaError(f"{err} (the heads are saved in {folder}: publish them later with "
                              f"`python scripts/publish_heads.py {folder} --repo-id {cfg.hub_model_id}`)") from None
        log.info("heads published at %s", url)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MedusaError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
