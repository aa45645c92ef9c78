"""Real ``torchrun --rdzv-backend=elasticzero`` agents on an etcd v3 endpoint, including etcd faults."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rdzv_agents import (
    agents_reaped,
    read_records,
    start_agent,
    torchrun_argv,
    wait_all,
    wait_for_files,
)
from rdzv_world import assert_one_world

from cluster.etcd_server import EtcdCluster
from ez_testing import free_port

pytestmark = [pytest.mark.etcd, pytest.mark.multiproc, pytest.mark.timeout(240)]

FAST = ("keep_alive_interval=2", "lease_ttl=10")


def _run_world(cluster: EtcdCluster, tmp_path: Path, nnodes: int, nproc: int, run_id: str) -> None:
    with agents_reaped() as agents:
        for i in range(nnodes):
            argv = torchrun_argv(cluster.endpoint(), run_id, str(nnodes), tmp_path, rdzv_conf=FAST, nproc=nproc)
            agents.append(start_agent(argv, tmp_path / f"agent{i}.log"))
        codes = wait_all(agents, timeout=180)
        assert codes == [0] * nnodes, [a.output()[-2500:] for a in agents]
    assert_one_world(read_records(tmp_path, nnodes * nproc), nnodes, nproc, run_id)


def _keys_left(cluster: EtcdCluster, run_id: str) -> str:
    return cluster.etcdctl("get", "--prefix", "--keys-only", f"/elasticzero/{run_id}/").strip()


#: the job each etcd version runs: three nodes of one worker, two of two — a world of three nodes and a local world
#: of two are each formed once (one job a version, not one a shape and a version)
SHAPES = {"3.4": (3, 1), "3.5": (2, 2)}


def test_agents_form_one_world_and_clean_up_their_keys(
    etcd_any: EtcdCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    nnodes, nproc = SHAPES[request.node.callspec.params["etcd_any"]]
    run_id = f"etcd{nnodes}x{nproc}"
    _run_world(etcd_any, tmp_path, nnodes=nnodes, nproc=nproc, run_id=run_id)
    assert _keys_left(etcd_any, run_id) == ""


def _run_with_fault(cluster: EtcdCluster, tmp_path: Path, run_id: str, fault: object) -> None:
    with agents_reaped() as agents:
        for i in range(2):
            argv = torchrun_argv(cluster.endpoint(), run_id, "2", tmp_path, rdzv_conf=FAST, sleep_s=8)
            agents.append(start_agent(argv, tmp_path / f"agent{i}.log"))
        wait_for_files([tmp_path / "started0", tmp_path / "started1"], timeout=120, agents=agents)
        fault()  # type: ignore[operator]
        codes = wait_all(agents, timeout=150)
        assert codes == [0, 0], [a.output()[-2500:] for a in agents]
    assert_one_world(read_records(tmp_path, 2), 2, 1, run_id)


def test_etcd_restarted_mid_run(etcd: EtcdCluster, tmp_path: Path) -> None:
    def restart() -> None:
        etcd.kill(0)
        time.sleep(2.5)  # longer than one keep-alive interval: heartbeats fail meanwhile
        etcd.restart(0)

    _run_with_fault(etcd, tmp_path, "restart", restart)


def test_one_member_of_three_killed_mid_run(etcd3: EtcdCluster, tmp_path: Path) -> None:
    _run_with_fault(etcd3, tmp_path, "hakill", lambda: etcd3.kill(0))


def test_etcd_unreachable_at_start_is_a_clear_error(tmp_path: Path) -> None:
    endpoint = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    argv = torchrun_argv(endpoint, "nope", "1", tmp_path, rdzv_conf=["connect_timeout=2"])
    t0 = time.monotonic()
    with agents_reaped() as agents:
        agents.append(start_agent(argv, tmp_path / "agent.log"))
        codes = wait_all(agents, timeout=60)
    assert codes[0] != 0
    assert time.monotonic() - t0 < 45
    out = agents[0].output()
    assert "cannot reach etcd at http://127.0.0.1:" in out
    assert "connect_timeout=2s" in out
