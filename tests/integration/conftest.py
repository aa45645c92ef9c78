"""Fixtures shared by the integration tests that run real ``elasticzero-run`` agents (``agent/``, ``elastic/``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("agent")))  # the agent tests' kit: start, watch, reap agents
from ez_agentkit import Cluster

from cluster.etcd_server import EtcdCluster, require_etcd
from ez_testing import free_port


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A job with a unique id; every process it started (stopped ones included) is killed afterwards."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


@pytest.fixture(params=["c10d", pytest.param("etcd", marks=pytest.mark.etcd)])
def endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``(rdzv, endpoint)``: a free loopback port for a c10d rendezvous (its first agent hosts the store), or a real
    one-member etcd 3.4 server for elasticzero's etcd rendezvous (stopped afterwards)."""
    if request.param == "c10d":
        yield "c10d", f"127.0.0.1:{free_port()}"
        return
    etcd = EtcdCluster.start(tmp_path / "etcd", 1, require_etcd("3.4"))
    try:
        yield "etcd", etcd.endpoint()
    finally:
        etcd.stop()
