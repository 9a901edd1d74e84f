"""Large buffers that live for the whole process, on 2 MiB pages where Linux allows it.

Why: a decoding pass streams every weight once (about 0.5 GB for SmolLM2-135M in float32). On
4 KiB pages that is some 130k pages a pass, each a TLB miss and a page-table walk beside the
kernels' loads; on 2 MiB pages a few hundred. With transparent huge pages in ``madvise`` mode (the
common default, where only regions asked for get them) the gemv kernels' packed weights were
otherwise all on small pages (what it saves: docs/performance.md#huge-pages-for-the-packed-weights).

The hint (``madvise(MADV_HUGEPAGE)``) is given before the first write, so the pages are faulted in
huge; where the kernel says no (THP ``never``, another OS) the buffer is an ordinary one.
``MEDUSA_HUGE_PAGES=0`` in the environment turns it off (to compare).
"""

from __future__ import annotations

import mmap
import os
import sys

import torch

HUGE = 2 << 20  # bytes in a huge page (x86-64, arm64 with 4 KiB base pages)


def _wanted() -> bool:
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("MEDUSA_HUGE_PAGES", "1") != "0")


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` ``dtype`` values, in a fresh mapping of its own
    (no page of it touched yet, whatever the allocator holds) aligned to 2 MiB and asked to be
    backed by huge pages, when it spans at least one; else ``torch.empty``."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE or not _wanted():
        return torch.empty(numel, dtype=dtype)
    span = -(-nbytes // HUGE) * HUGE  # whole huge pages from the aligned start
    # private and anonymous (a shared mapping would be shmem, whose huge pages are another setting);
    # unmapped when the last tensor on it goes
    area = mmap.mmap(-1, span + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, span)  # a hint: a refusal leaves small pages
    except OSError:
        pass
    return raw[start:start + nbytes].view(dtype)
