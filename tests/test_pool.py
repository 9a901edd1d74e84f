"""The C kernels' own thread pool (medusa/runtime/pool.c), through the gemv and attention kernels
built here: the same bits from any thread, concurrent callers, and a forked child."""

from __future__ import annotations

import multiprocessing
import threading

import torch

from medusa.runtime import gemv


def _product(seed: int, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(1000, 320, generator=gen), torch.randn(rows, 320, generator=gen)
    return weight, x, gemv.product(x, gemv.pack(weight), 1000)


def test_other_threads_and_concurrent_callers_get_the_main_threads_bits():
    expected = {seed: _product(seed)[2] for seed in range(6)}
    got: dict[int, list[bool]] = {seed: [] for seed in expected}
    errors = []

    def worker(seed: int) -> None:
        try:
            weight, x, _ = _product(seed)
            packed = gemv.pack(weight)
            for _ in range(50):  # many jobs while the other threads run theirs
                got[seed].append(torch.equal(gemv.product(x, packed, 1000), expected[seed]))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert all(len(v) == 50 and all(v) for v in got.values())
    assert torch.allclose(expected[0], _product(0)[1] @ _product(0)[0].T, atol=1e-4)


def _in_child(queue) -> None:
    queue.put(_product(1)[2].numpy().tobytes())  # bytes: a tensor would travel as shared memory


def test_a_forked_child_runs_the_kernels():
    """The parent's workers do not exist in a fork: the child starts its own (it would hang otherwise)."""
    parent = _product(1)[2]  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert result == parent.numpy().tobytes()


def test_a_prompt_sized_product_matches_its_rows_alone():
    """Products of many rows run on OpenMP's threads, few rows on the pool: a row's bits are the same."""
    weight, x, _ = _product(2, rows=100)
    packed = gemv.pack(weight)
    many = gemv.product(x, packed, 1000)
    assert all(torch.equal(many[i], gemv.product(x[i:i + 1], packed, 1000)[0]) for i in (0, 37, 99))
