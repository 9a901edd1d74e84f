"""Huge-page buffers (medusa/runtime/pages.py): the packed weights the gemv kernels stream every
pass are asked for 2 MiB pages; the buffer is an ordinary tensor whatever the kernel grants."""

from __future__ import annotations

import sys

import pytest
import torch

from medusa.runtime import gemv, pages


def _huge_kib() -> int:
    with open("/proc/self/smaps_rollup", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def test_a_large_buffer_is_aligned_to_a_huge_page_and_holds_what_is_written():
    x = pages.empty(3 * pages.HUGE // 4 + 5, torch.float32)  # 3 MiB and a bit
    assert x.numel() == 3 * pages.HUGE // 4 + 5 and x.dtype == torch.float32 and x.is_contiguous()
    if pages._wanted():
        assert x.data_ptr() % pages.HUGE == 0
    x.copy_(torch.arange(x.numel(), dtype=torch.float32))
    assert x[-1].item() == x.numel() - 1
    small = pages.empty(10, torch.bfloat16)  # under a huge page: an ordinary tensor
    assert small.numel() == 10 and small.dtype == torch.bfloat16


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() == "never",
                    reason="transparent huge pages are off on this kernel")
def test_written_packed_weights_are_backed_by_huge_pages():
    if gemv.unavailable_reason() is not None:
        pytest.skip(gemv.unavailable_reason())
    before = _huge_kib()
    weight = torch.randn(2048, 1024)
    packed = gemv.pack(weight)  # 8 MiB packed, written once
    assert _huge_kib() - before >= 4 * 1024  # most of it on 2 MiB pages
    x = torch.randn(3, 1024)
    torch.testing.assert_close(gemv.product(x, packed, 2048), torch.nn.functional.linear(x, weight),
                               rtol=1e-4, atol=1e-4)
