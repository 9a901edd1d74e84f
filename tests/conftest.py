"""Shared fixtures. Tiny random models live in tiny.py; the embedded model is loaded once."""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def embedded():
    """The embedded default model (SmolLM2-135M-Instruct) as an Engine with fresh heads."""
    import medusa

    return medusa.load(heads="init", device="cpu")
