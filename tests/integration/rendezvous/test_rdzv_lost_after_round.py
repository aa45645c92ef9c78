"""A node lost right after a round completed must not stall the others (c10d and etcd, handlers in process).

The node ranks are re-ordered by ``node_rank_hint`` after torch's round completes. The hints used to be exchanged
then, in the round's store: a node that died between the round completing and publishing its hint left every other
node blocked on its key for the store's whole read timeout (60 s), after which the survivor's rendezvous failed and
its agent exited. Now each node publishes before joining, so the survivor finds every participant's hint at once.

What torch does after the hints is its own: every node but rank 0 reads the workers' master address that rank 0
publishes. If rank 0 is lost in that window the read times out (``read_timeout``); the handler then joins the next
round instead of failing the agent.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.handler import create_rdzv_handler
from ez_testing import free_port

pytestmark = pytest.mark.timeout(120)
LOST_NODE = Path(__file__).with_name("rdzv_lost_node.py")


def _endpoints(kind: str, request: pytest.FixtureRequest) -> tuple[str, list[dict[str, str]]]:
    """The endpoint and per-node extra options (c10d: the first handler hosts the TCPStore)."""
    if kind == "etcd":
        cluster: EtcdCluster = request.getfixturevalue("etcd")
        return cluster.endpoint(), [{}, {}]
    return f"127.0.0.1:{free_port()}", [{"is_host": "1"}, {"is_host": "0"}]


class NodeLost(Exception):
    """What the lost node's handler raises where it would have read the others' hints."""


@pytest.mark.parametrize("kind", ["c10d", "etcd"])
def test_survivor_of_a_node_lost_after_the_round_gets_its_hinted_rank_at_once(
    kind: str, request: pytest.FixtureRequest
) -> None:
    endpoint, extra = _endpoints(kind, request)
    run = uuid.uuid4().hex[:12]
    # torch ranks by address (.1 before .2); the hints put the survivor (.2) first, so it reads the lost node's hint
    # and it hosts the workers' bootstrap (a node other than rank 0 waits for rank 0's address: torch's, not ours).
    nodes = [("127.0.0.1", "1"), ("127.0.0.2", "0")]
    handlers = [
        create_rdzv_handler(
            RendezvousParameters("elasticzero", endpoint, run, 2, 2, local_addr=addr, node_rank_hint=hint, **conf)
        )
        for (addr, hint), conf in zip(nodes, extra, strict=True)
    ]
    lost, survivor = handlers

    def lost_world() -> Any:
        raise NodeLost

    lost._get_world = lost_world  # type: ignore[method-assign]
    outcome: dict[str, Any] = {}

    def join(name: str, handler: Any) -> None:
        try:
            outcome[name] = handler.next_rendezvous()
        except Exception as exc:
            outcome[name] = exc

    threads = [threading.Thread(target=join, args=(n, h)) for n, h in (("lost", lost), ("survivor", survivor))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(45)  # the old exchange held the survivor for the 60 s read timeout, then failed it
        assert not any(t.is_alive() for t in threads), f"a join is still blocked: {outcome}"
        assert isinstance(outcome["lost"], NodeLost)
        info = outcome["survivor"]
        assert isinstance(info, RendezvousInfo), info
        assert (info.rank, info.world_size) == (0, 2)
        assert info.bootstrap_store_info.master_addr == "127.0.0.2"
    finally:
        for h in reversed(handlers):  # the c10d store's host last
            h.shutdown()


@pytest.mark.parametrize("kind", ["c10d", "etcd"])
def test_rank0_killed_after_the_round_the_survivor_joins_the_next_round(
    kind: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint, extra = _endpoints(kind, request)
    run = uuid.uuid4().hex[:12]
    # the master-address read gives up after 5 s and a silent node is dead after 3 s; a round that reached its
    # minimum (1) waits 10 s for more nodes: the lost node has joined long before (it prints "joining" right before
    # its join RPC), so round 0 has both nodes and the round after it only the survivor
    conf = {"read_timeout": "5", "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "10"}
    survivor = create_rdzv_handler(
        RendezvousParameters(
            "elasticzero", endpoint, run, 1, 2, local_addr="127.0.0.1", node_rank_hint="1", **conf, **extra[0]
        )
    )
    argv = [str(LOST_NODE), endpoint, run, "127.0.0.2", "1:2", "node_rank_hint=0"]
    argv += [f"{k}={v}" for k, v in {**conf, **extra[1]}.items()]
    lost = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True)
    try:
        assert lost.stdout is not None and lost.stdout.readline().strip() == "joining"
        info = survivor.next_rendezvous()  # round 0 with both (rank 0 dies in it), then a round without it
        assert lost.wait(30) == -9 and lost.stdout.read() == ""
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert "its rank 0 never published the master address" in caplog.text  # round 0 had both nodes
    finally:
        lost.kill()
        lost.wait()
        survivor.shutdown()
