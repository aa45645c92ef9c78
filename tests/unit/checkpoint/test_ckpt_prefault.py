"""Prefaulter (checkpoint/prefault.py): the whole pages inside each destination, populated in a thread without
changing what the memory holds; what it cannot populate (not contiguous, not CPU, an old kernel) is left alone."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from elasticzero.checkpoint.prefault import Prefaulter, page_range

PAGE = mmap.PAGESIZE


@pytest.mark.parametrize(
    ("address", "nbytes", "want"),
    [
        (0, 3 * PAGE, (0, 3 * PAGE)),  # aligned both ends
        (10, 3 * PAGE, (PAGE, 2 * PAGE)),  # the partial pages at both ends are the reader's
        (PAGE, PAGE - 1, (PAGE, 0)),  # less than a page
        (PAGE + 1, PAGE, (2 * PAGE, 0)),  # straddles one boundary: no whole page
        (5, 0, (PAGE, 0)),
    ],
)
def test_page_range_is_the_whole_pages_inside(address: int, nbytes: int, want: tuple[int, int]) -> None:
    assert page_range(address, nbytes, PAGE) == want


def _kernel_has_populate_write() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 14)


@pytest.mark.skipif(not _kernel_has_populate_write(), reason="MADV_POPULATE_WRITE needs Linux >= 5.14")
def test_populates_fresh_buffers_and_leaves_contents_alone() -> None:
    region = mmap.mmap(-1, 8 << 20)  # 8 MiB of anonymous memory nobody touched yet
    fresh = torch.frombuffer(region, dtype=torch.uint8)
    held = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB with known contents
    before = _resident_bytes()
    with Prefaulter([fresh, held]) as p:
        pass
    assert _resident_bytes() - before >= 7 << 20  # the fresh pages are now mapped
    assert p.populated == (8 << 20) + page_range(held.data_ptr(), held.numel() * 4)[1]
    assert torch.equal(held, torch.arange(1 << 20, dtype=torch.float32))
    assert int(fresh.sum()) == 0  # populated pages are zero pages, as a first touch would give
    fresh.fill_(7)  # still ordinary writable memory
    assert int(fresh.sum()) == 7 * fresh.numel()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_skips_what_it_cannot_populate() -> None:
    strided = torch.zeros(1 << 20)[::2]
    with Prefaulter([strided]) as p:
        pass
    assert p.populated == 0
    assert Prefaulter([]).__enter__().populated == 0


def test_an_error_in_the_block_stops_the_rest() -> None:
    tensors = [torch.zeros(4 * PAGE, dtype=torch.uint8) for _ in range(3)]
    calls: list[tuple[int, int, int]] = []

    def madvise(start: int, length: int, advice: int) -> int:
        calls.append((start, length, advice))
        p.__exit__(RuntimeError, RuntimeError("read failed"), None)  # the reader fails while the first is populated
        return 0

    p = Prefaulter(tensors)
    p._run(madvise)  # the thread's body, run here: deterministic
    assert len(calls) == 1 and calls[0][2] == 23 and p.populated == calls[0][1]
