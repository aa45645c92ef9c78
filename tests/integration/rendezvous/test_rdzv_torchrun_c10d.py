"""Real ``torchrun --rdzv-backend=elasticzero`` agents on loopback with the c10d (TCPStore) endpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from rdzv_agents import agents_reaped, read_records, start_agent, torchrun_argv, wait_all
from rdzv_world import assert_one_world

from ez_testing import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def test_two_agents_form_one_world(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with agents_reaped() as agents:
        for i in range(2):
            agents.append(
                start_agent(torchrun_argv(endpoint, "c10d2", "2", tmp_path, nproc=2), tmp_path / f"agent{i}.log")
            )
        codes = wait_all(agents, timeout=150)
        assert codes == [0, 0], [a.output()[-2000:] for a in agents]
    assert_one_world(read_records(tmp_path, 4), 2, 2, "c10d2")


def test_node_rank_hint_orders_group_ranks_and_master(tmp_path: Path) -> None:
    """Three agents form one world (on a ``tcp://`` endpoint); addresses sort .1 < .2 < .3 but the hints say .2, .3,
    .1: ranks and MASTER_ADDR follow the hints."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    hints = {"127.0.0.1": 2, "127.0.0.2": 0, "127.0.0.3": 1}
    with agents_reaped() as agents:
        for addr, hint in hints.items():
            argv = torchrun_argv(
                endpoint, "hinted", "3", tmp_path, rdzv_conf=[f"node_rank_hint={hint}"], local_addr=addr
            )
            agents.append(start_agent(argv, tmp_path / f"agent{hint}.log", env={"EZ_TEST_NODE": addr}))
        codes = wait_all(agents, timeout=150)
        assert codes == [0, 0, 0], [a.output()[-2000:] for a in agents]
    records = read_records(tmp_path, 3)
    assert_one_world(records, 3, 1, "hinted")
    assert [r["node_addr_hint"] for r in records] == ["127.0.0.2", "127.0.0.3", "127.0.0.1"]
    assert {r["MASTER_ADDR"] for r in records} == {"127.0.0.2"}
