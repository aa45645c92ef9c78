"""One rank of ``test_lost_connection.py``: a group of two formed as a live round forms it (``RoundGroups``); rank 1
starts sending rank 0 a 400 MB message and SIGKILLs itself while it is in flight. Rank 0 prints what its receive does
on its own (gloo: nothing — it neither completes nor fails) and what the bounded wait with the group's connection watch
does (leaves with ``PeerConnectionLost``), with the seconds it took.

    python lost_connection_worker.py RANK PORT
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticzero.live.bounded import BoundedWait, PeerConnectionLost
from elasticzero.live.group import GroupSpec, RoundGroups

NUMEL = 100_000_000  # 400 MB: on loopback in flight for ~0.1 s, far longer than the 20 ms the sender lives after
RAW_S = 1.5  # how long rank 0 watches the receive on its own


def main(rank: int, port: int) -> None:
    groups = RoundGroups()
    spec = GroupSpec("gloo", rank, 2, "127.0.0.1", port, rank == 0, "lost/", None, timedelta(seconds=60))
    groups.form(spec)
    store = dist.PrefixStore("lost/", groups._stores[("127.0.0.1", port)])
    if rank == 1:
        store.wait(["posted"])
        dist.isend(torch.ones(NUMEL), dst=0, tag=9)
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    work = dist.irecv(torch.empty(NUMEL), src=1, tag=9)
    store.set("posted", "1")
    time.sleep(RAW_S)
    print(f"raw receive after {RAW_S} s: completed={work.is_completed()}", flush=True)
    bound = BoundedWait(lambda: None, poll_s=0.05, failure_grace_s=0.2, lost=groups.lost)
    start = time.monotonic()
    try:
        bound(work.wait)
        print("bounded wait: returned", flush=True)
    except PeerConnectionLost as exc:
        print(f"bounded wait: PeerConnectionLost after {time.monotonic() - start:.2f} s: {exc}", flush=True)
    os._exit(0)  # the receive's thread stays blocked in gloo


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
