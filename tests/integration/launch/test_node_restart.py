"""The launcher keeps its nodes (issue 33, ``--max-node-restarts``): on the namespace hosts, over real pdsh and sshd,
one node of an elastic job is lost in one of two ways, and the launcher brings it back:

* ``killed``: every process of the node — agent, worker and the host's sshd — SIGKILLed (a crashed host); sshd comes
  back 3 s later (``tests/cluster/hosts_up.sh``), and until then the launcher's tries to reach the host fail;
* ``ssh``: only the sshd session that carries the launcher's connection to it SIGKILLed — the agent and its worker
  live on, out of the launcher's reach (a dropped connection).

The launcher sees that node's ``pdsh -w HOST`` end with a node loss and says so in one line; after the backoff it
stops what is left of that node (``--kill-job JOB --node-host HOST``: in the ``ssh`` case the still-running agent,
never the other node's processes, though the namespace hosts share one process table), stages its environment again
and starts its agent, which joins as a new node: the job is back at world 2, one agent on each host. Then the job
finishes: the launcher exits 0 and leaves nothing on any host.

The survivor's worker sees the lost peer's sockets close and fails its collective: its agent re-forms through a
worker restart (``--max-restarts``, as for any crashed peer without ``--live-recovery``).

Hosts 2 and 3 of the test bed, as the partition tests (node rank 0, host 2, holds the c10d store: the node lost is
the other one).
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from launchkit import kill_job, leftovers, wait_for
from test_partition import _start, _stop, _world_of_two, reports

import ez_testing
from ez_testing import REPO, free_port, require, require_program

pytestmark = [pytest.mark.multiproc, pytest.mark.pdsh, pytest.mark.sshd, pytest.mark.timeout(240)]


def _listener(host: str) -> psutil.Process:
    """The host's sshd listener (tests/cluster/hosts_up.sh writes its pid file)."""
    return psutil.Process(int(Path(f"/run/elasticzero-testbed/sshd-{host}.pid").read_text()))


def _ssh_session(agent: int, host: str) -> list[psutil.Process]:
    """The sshd processes serving the connection that started ``agent`` (its sshd ancestors below the listener)."""
    listener = _listener(host).pid
    return [p for p in psutil.Process(agent).parents() if p.name() == "sshd" and p.pid != listener]


def _agent(pids: list[int]) -> int:
    """The agent among a node's processes (the one started with ``--node-host``)."""
    return next(pid for pid in pids if "--node-host" in psutil.Process(pid).cmdline())


@pytest.mark.parametrize("lost", ["killed", "ssh"])
def test_a_lost_node_is_started_again_and_rejoins(tmp_path: Path, lost: str) -> None:
    tb = ez_testing.testbed()
    require_program("pdsh")
    require(len(tb.hosts) >= 3, "the test uses hosts 2 and 3 of the test bed (1 and 2 serve other tests)")
    hosts = [tb.hosts[1], tb.hosts[2]]
    job = f"ezrestart-{secrets.token_hex(4)}"
    flags = ["--master-port", str(free_port()), "--max-node-restarts", "2", "--max-restarts", "3"]
    launcher, out, log = _start(tmp_path, hosts, job, *flags)
    try:
        _world_of_two(launcher, out, log)
        first = {r["pid"] for r in reports(out)}
        victims = leftovers(job, tb)[hosts[1]]  # the agent and its worker on the second host
        assert len(victims) == 2, victims
        session = _ssh_session(_agent(victims), hosts[1])
        assert session, "no sshd process above the agent"
        doomed = [_listener(hosts[1]), *[psutil.Process(pid) for pid in victims]] if lost == "killed" else session
        t_kill = time.time()
        for proc in doomed:
            proc.send_signal(signal.SIGKILL)
        tail = lambda: log.read_text()[-4000:]  # noqa: E731
        line = f"elasticzero-launch: {hosts[1]}'s agent ended ("
        wait_for(lambda: line in log.read_text(), 60, f"the launcher's line on {hosts[1]}", tail)
        assert "starting it again in 1 s (node restart 1 of 2)" in log.read_text(), tail()
        if lost == "killed":  # the host's sshd comes back; meanwhile the launcher cannot reach the host
            wait_for(lambda: f"cannot start {hosts[1]}'s agent again yet" in log.read_text(), 30, "a failed try", tail)
            time.sleep(max(0.0, t_kill + 3 - time.time()))
            subprocess.run(["bash", str(REPO / "tests" / "cluster" / "hosts_up.sh")], check=True, timeout=120)
            t_sshd = time.time()
        back = lambda: [r for r in reports(out) if r["world_size"] == 2 and r["time"] > t_kill]  # noqa: E731
        wait_for(lambda: len(back()) == 2, 120, "world 2 again after the restart", tail)
        print(f"node restart ({lost}): world 2 again {min(r['time'] for r in back()) - t_kill:.2f} s after the loss")
        if lost == "killed":
            print(f"node restart (killed): world 2 again {min(r['time'] for r in back()) - t_sshd:.2f} s after sshd")
        assert len({r["pid"] for r in back()} - first) >= 1  # a fresh worker on the restarted node
        now = leftovers(job, tb)  # one agent and one worker per host: the one lost out of reach was stopped
        assert [len(now.get(h, [])) for h in hosts] == [2, 2], now
        _stop(launcher, out, log, job, tb)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_job(job)
