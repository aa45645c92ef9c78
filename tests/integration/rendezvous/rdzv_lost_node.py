"""A rendezvous node that dies (SIGKILL, its own) the moment torch's round completes with it: run as a program.

    python rdzv_lost_node.py ENDPOINT RUN_ID LOCAL_ADDR MIN:MAX KEY=VALUE...

Prints ``joining`` before it joins. The KEY=VALUE pairs are the handler's options (``--rdzv-conf``).
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticzero.rendezvous.handler import create_rdzv_handler


def main(endpoint: str, run_id: str, local_addr: str, nnodes: str, *conf: str) -> None:
    lo, hi = (int(n) for n in nnodes.split(":"))
    options = dict(kv.split("=", 1) for kv in conf)
    handler = create_rdzv_handler(
        RendezvousParameters("elasticzero", endpoint, run_id, lo, hi, local_addr=local_addr, **options)
    )
    handler._get_world = lambda: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    print("joining", flush=True)
    handler.next_rendezvous()
    print("still alive", flush=True)  # unreachable


if __name__ == "__main__":
    main(*sys.argv[1:])
