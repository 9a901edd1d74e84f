"""Shared fixtures. Tiny random models live in tiny.py; the embedded model is loaded once."""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The chat's default (--compile auto) starts compiling its passes in a background process on a
# CPU; the chat tests run it eagerly, and tests/test_compile_auto.py asks for auto itself.
os.environ["MEDUSA_COMPILE"] = "off"
# Tokenised rows are cached in the datasets cache: the tests (and the runs they launch) use a
# fresh one, so nothing is read from or left in the user's.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="medusa-tests-datasets-")
atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], True)


def _private_medusa_cache() -> str:
    """A medusa cache for this test session: the measured picks the tests make on tiny models
    (plan.json) land there, not in the user's cache; the heavy
    entries of the user's cache (the materialised embedded model, the vLLM and llama.cpp venvs) are linked in."""
    from pathlib import Path

    user = Path(os.environ.get("MEDUSA_CACHE", Path.home() / ".cache" / "medusa"))
    private = Path(tempfile.mkdtemp(prefix="medusa-tests-cache-"))
    user.mkdir(parents=True, exist_ok=True)
    for name in ("models", "vllm-venv", "llamacpp-venv"):
        (user / name).mkdir(exist_ok=True)
        (private / name).symlink_to(user / name, target_is_directory=True)
    atexit.register(shutil.rmtree, str(private), True)
    return str(private)


os.environ["MEDUSA_CACHE"] = _private_medusa_cache()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one intra-op thread each, not two spinning
    # threads per worker fighting over the cores.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """A test that loads the embedded model (the ``embedded`` fixture: 130 M parameters, seconds
    to load in each process) is an end-to-end test: the development loop runs tiny models only."""
    for item in items:
        if "embedded" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("peers"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def embedded():
    """The embedded default model (SmolLM2-135M-Instruct) as an Engine with fresh heads, in
    float32: tests compare a reused cache (chat turns) with decoding from scratch, which
    prefills the same tokens in one pass; in bfloat16 that pass rounds its rows differently
    from the rows decoding computed (bfloat16's exactness is tested in test_exact.py)."""
    import medusa

    return medusa.load(heads="init", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: they are all per-call overhead,
    and two spinning threads make each forward several times slower on a busy CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
