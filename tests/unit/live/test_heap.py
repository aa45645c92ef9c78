"""``trim_heap``: what a round change frees inside glibc's heap goes back to the system. The setup is glibc's own rule
(a canary of it too): once a freed mmap'd block raised the dynamic mmap threshold, blocks below it come from the heap,
and freed there — below a block still in use — they stay resident until ``malloc_trim``.

The scenario runs in a fresh interpreter: "below a block still in use" holds only on a heap no earlier test left holes
in (in a long test process the block kept may land in such a hole, below the freed ones, and glibc then gives the
freed top back at ``free`` by itself — the heap's state, not ``trim_heap``, decided the test: seen under xdist)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elasticzero.live.group import _malloc_trim

SCENARIO = """
import json, torch
from elasticzero.live.group import trim_heap
MB = 2**20
def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / MB
torch.empty(16 * MB // 4).fill_(1)  # freed at once: glibc raises its mmap threshold to 16 MB
blocks = [torch.ones(8 * MB // 4) for _ in range(40)]  # 320 MB below the threshold: from the heap, touched
keep = torch.ones(8 * MB // 4)  # above them: the heap's top stays in use, so free() alone cannot shrink it
before = resident_mb()
del blocks
freed = resident_mb()
trim_heap()
print(json.dumps([before, freed, resident_mb()]))
"""


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: trim_heap does nothing")
def test_freed_heap_memory_goes_back_once_trimmed() -> None:
    out = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120, check=True)
    before, freed, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert freed > before - 100, (before, freed)  # glibc kept the freed blocks resident (the fragmentation)
    assert after < freed - 200, (before, freed, after)  # trimmed: most of the 320 MB is back with the system
