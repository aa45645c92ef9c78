"""``trim_heap``: what a round change frees inside glibc's heap goes back to the system. The setup is glibc's own rule
(a canary of it too): once a freed mmap'd block raised the dynamic mmap threshold, blocks below it come from the heap,
and freed there — below a block still in use — they stay resident until ``malloc_trim``."""

from __future__ import annotations

import pytest
import torch

from elasticzero.live.group import _malloc_trim, trim_heap

MB = 2**20


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / MB


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: trim_heap does nothing")
def test_freed_heap_memory_goes_back_once_trimmed() -> None:
    torch.empty(16 * MB // 4).fill_(1)  # freed at once: glibc raises its mmap threshold to 16 MB
    blocks = [torch.ones(8 * MB // 4) for _ in range(40)]  # 320 MB below the threshold: from the heap, touched
    keep = torch.ones(8 * MB // 4)  # above them: the heap's top stays in use, so free() alone cannot shrink it
    before = resident_mb()
    del blocks
    freed = resident_mb()
    trim_heap()
    after = resident_mb()
    assert freed > before - 100, (before, freed)  # glibc kept the freed blocks resident (the fragmentation)
    assert after < freed - 200, (before, freed, after)  # trimmed: most of the 320 MB is back with the system
    del keep
