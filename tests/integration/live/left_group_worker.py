"""One rank of ``test_left_group.py``: a group of two formed as a live round forms it (``RoundGroups``); rank 1
freezes (SIGSTOP) once the group is up, rank 0 posts an all-reduce of a 100 MB tensor it can never complete, then
leaves the group for a round of its own (world 1, as a survivor does). It prints whether the pending all-reduce still
holds its tensor after the group was left (gloo: yes — its abort and shutdown leave a pending operation pending, until
the group's timeout), then after :meth:`RoundGroups.cut_left`.

    python left_group_worker.py RANK PORT PORT2
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticzero.live.group import GroupSpec, RoundGroups

NUMEL = 25_000_000  # 100 MB
TIMEOUT = timedelta(seconds=300)  # the group's timeout: far beyond this test's life


def held(ref: weakref.ref[torch.Tensor]) -> bool:
    gc.collect()
    return ref() is not None


def main(rank: int, port: int, port2: int) -> None:
    groups = RoundGroups()
    groups.form(GroupSpec("gloo", rank, 2, "127.0.0.1", port, rank == 0, "r0/", None, TIMEOUT))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.2)  # rank 1 stopped meanwhile (it stops itself right after the barrier)
    tensor = torch.ones(NUMEL)
    ref = weakref.ref(tensor)
    work = dist.all_reduce(tensor, async_op=True)
    del tensor
    groups.form(GroupSpec("gloo", 0, 1, "127.0.0.1", port2, True, "r1/", None, TIMEOUT))  # the next round, alone
    time.sleep(1.0)
    print(f"left: completed={work.is_completed()} held={held(ref)}", flush=True)
    start = time.monotonic()
    cut = groups.cut_left()
    while not work.is_completed() and time.monotonic() - start < 30:
        time.sleep(0.01)
    took = time.monotonic() - start
    del work
    print(f"cut {cut} connection(s): completed after {took:.2f} s, held={held(ref)}", flush=True)
    print(f"again: {groups.cut_left()}", flush=True)  # each group left is cut once
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
