"""What the agent's rendezvous tests over torch's real c10d rendezvous share: a node in a subprocess (to SIGKILL),
and a rendezvous call on a thread."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousInfo

NODE = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
port, run_id, max_nodes, last_call, attempts = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
store = TCPStore("127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=30))
handler = DynamicRendezvousHandler.from_backend(
    run_id, store, C10dRendezvousBackend(store, run_id), 1, max_nodes,
    timeout=RendezvousTimeout(last_call=timedelta(seconds=last_call)),
    keep_alive_interval=1, keep_alive_max_attempt=attempts,
)
handler.next_rendezvous()
print(repr(handler._this_node), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def node_process(
    port: int, run_id: str, max_nodes: int, last_call_s: int, peer_timeout_s: int
) -> Iterator[subprocess.Popen[str]]:
    """A node joining ``run_id`` on the c10d store at ``port`` in a subprocess (min 1 node, ``max_nodes``, the last
    call, heartbeats every second for ``peer_timeout_s``); it prints its node's ``repr`` once the round completed.
    Killed on exit."""
    args = [str(port), run_id, str(max_nodes), str(last_call_s), str(peer_timeout_s)]
    proc = subprocess.Popen([sys.executable, "-c", NODE, *args], stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def in_thread(call: Callable[[], RendezvousInfo], timeout_s: float = 60) -> Callable[[], RendezvousInfo]:
    """Start ``call`` on a thread; the returned function waits ``timeout_s`` for its result (its error is raised)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test's thread
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result() -> RendezvousInfo:
        thread.join(timeout=timeout_s)
        assert out, f"the rendezvous did not complete within {timeout_s:.0f} s"
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    return result
