"""Fixtures shared by the integration tests that run real ``elasticzero-run`` agents (``agent/``, ``elastic/``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("agent")))  # the agent tests' kit: start, watch, reap agents
from ez_agentkit import Cluster

from cluster.etcd_server import EtcdCluster, require_etcd
from ez_testing import IN_CI, free_port

#: markers of the tests that run on the shared test bed (namespace hosts, their links, one Slurm cluster)
TESTBED = ("sshd", "pdsh", "openmpi", "mpich", "slurm")
#: the nice value of a ``clock`` test and every process it starts: ahead of the waiting tests beside it (nice 0, a
#: weight ~9x lower) and far ahead of the busy stream (nice 10, ~87x lower)
CLOCK_NICE = -10


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (tests/run.sh): the test-bed tests on one worker, one at a time (they
    share its hosts, and one takes their links down), and likewise the ``clock`` tests — a bound of seconds in their
    assertions — so that no two of them contend for the cores; the rest spread over the workers."""
    for item in items:
        if any(item.get_closest_marker(m) for m in TESTBED):
            item.add_marker(pytest.mark.xdist_group("testbed"))
        elif item.get_closest_marker("clock"):
            item.add_marker(pytest.mark.xdist_group("clock"))


@pytest.fixture(autouse=True)
def _clock_first(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``clock`` test (a bound of seconds in its assertions) runs, with every process it starts, at nice
    ``CLOCK_NICE``: its bound then measures its own agents and workers, not the tests that tests/run.sh keeps beside it
    on the cores (which turns the kernel's autogroups off for the run, so that a nice value ranks processes across the
    sessions that agents, torch workers and etcd servers each start). Needs root (tests/run.sh runs as root); outside
    CI, without it, the test runs at the caller's priority."""
    if request.node.get_closest_marker("clock") is None:
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's (Linux: a per-thread value, inherited on fork)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, CLOCK_NICE)
    except PermissionError:
        if IN_CI:
            pytest.fail(f"a clock test needs nice {CLOCK_NICE} under CI=true: run as root", pytrace=False)
        before = None
    try:
        yield
    finally:
        if before is not None:
            os.setpriority(os.PRIO_PROCESS, 0, before)  # back down: no privilege needed


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
