"""``--kill-job JOB --node-host HOST``: only that node's processes (pure selection, :func:`node_processes`)."""

from __future__ import annotations

from elasticzero.agent.killjob import JobProcess, node_host_of, node_processes

AGENT = ("python", "-m", "elasticzero.agent.cli", "--nnodes", "1:2")


def test_the_node_host_flag_in_both_spellings() -> None:
    assert node_host_of([*AGENT, "--node-host", "node2", "x.py"]) == "node2"
    assert node_host_of([*AGENT, "--node-host=node3"]) == "node3"
    assert node_host_of(AGENT) is None
    assert node_host_of([*AGENT, "--node-host"]) is None


def test_a_nodes_agent_its_workers_and_dead_agents_orphans_only() -> None:
    procs = [
        JobProcess(10, (*AGENT, "--node-host", "node2"), None),  # node2's agent
        JobProcess(11, ("python", "train.py"), 10),  # its worker
        JobProcess(20, (*AGENT, "--node-host", "node3"), None),  # another node's agent (same process table)
        JobProcess(21, ("python", "train.py"), 20),  # its worker: kept
        JobProcess(31, ("python", "train.py"), 30),  # its agent (30) is gone: an orphan, taken
    ]
    assert node_processes(procs, "node2") == [10, 11, 31]
    assert node_processes(procs, "node3") == [20, 21, 31]
    assert node_processes(procs, "node9") == [31]
