"""A real network partition during a pdsh-launched elastic job: packets between two namespace hosts are dropped (tc
filters inside both namespaces, removed in a ``finally``: ``ez_testing.partition``), then the cut heals.

Hosts 2 and 3 of the test bed (node rank 0 hosts the job's c10d store); the workers all-reduce in a loop
(``ez_agent_worker.py loop=1``). Node 0 no longer hears node 1's heartbeat: after the peer timeout it re-forms the
round and trains on alone. Node 1 can no longer reach the store: it says so in one line, stops its workers and stays
(issue 33): when the cut heals it joins again as a new node and the job is back at world 2; then it finishes (exit 0).
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launchkit import kill_job, leftovers, wait_for, worker_env_clean

import ez_testing
from cluster.etcd_server import EtcdCluster, require_etcd
from elasticzero.agent.liveness import DEFAULT_PEER_TIMEOUT_S
from elasticzero.agent.options import RDZV_DEFAULTS
from ez_testing import REPO, agents_slack, free_port, link_down, partition, require, require_program

LAUNCH = str(Path(sys.executable).parent / "elasticzero-launch")
WORKER = str(REPO / "tests" / "integration" / "agent" / "ez_agent_worker.py")
pytestmark = [pytest.mark.multiproc, pytest.mark.pdsh, pytest.mark.sshd, pytest.mark.timeout(180)]
#: the issue's goal: the survivors train again within 10 s of the cut, with default settings (printed)
RECOVERY_S = 10.0


def reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("report.*.json")]


def _start(tmp_path: Path, hosts: list[str], job: str, *flags: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``elasticzero-launch`` of the agent worker on ``hosts`` over pdsh, ``--nnodes 1:2``, with the rendezvous
    ``flags``: the launcher, the folder of the ranks' reports, and the launcher's log."""
    out, log = tmp_path / "out", tmp_path / "launch.log"
    out.mkdir()
    (tmp_path / "hostfile").write_text(f"{hosts[0]} slots=1\n{hosts[1]} slots=1\n")
    argv = [LAUNCH, "--hostfile", str(tmp_path / "hostfile"), "--launcher", "pdsh", "--nnodes", "1:2", *flags]
    argv += ["--rdzv-id", job, WORKER, str(out), "loop=1"]
    with log.open("w") as fh:
        launcher = subprocess.Popen(argv, env={**worker_env_clean(), "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                                    stdout=fh, stderr=subprocess.STDOUT)  # fmt: skip
    return launcher, out, log


def netns_of(pid: int) -> str:
    """The name of the network namespace process ``pid`` runs in (a test bed host's), "" if none has a name."""
    found = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True, check=False)
    return found.stdout.strip()


def _world_of_two(launcher: subprocess.Popen[bytes], out: Path, log: Path) -> None:
    wait_for(lambda: len(reports(out)) == 2 or launcher.poll() is not None, 120, "a world of 2 on both hosts")
    assert launcher.poll() is None, log.read_text()[-3000:]


def _stop(launcher: subprocess.Popen[bytes], out: Path, log: Path, job: str, tb: ez_testing.Testbed) -> str:
    """Ask the workers to stop; the launcher exits 0, no traceback, nothing of the job left anywhere: its log."""
    (out / "stop").touch()
    launcher.wait(timeout=60)
    text = log.read_text()
    assert launcher.returncode == 0, text[-3000:]
    assert "Exception ignored" not in text and not re.search(r"^[\w.-]+: Traceback", text, re.M), text[-3000:]
    wait_for(lambda: not leftovers(job, tb), 20, "no process of the job on any host")
    return text


def test_a_partitioned_node_is_dropped_and_the_survivor_trains_on(tmp_path: Path) -> None:
    tb = ez_testing.testbed()
    require_program("pdsh", "tc")
    require(len(tb.hosts) >= 3, "the partition test uses hosts 2 and 3 of the test bed (1 and 2 serve other tests)")
    hosts = [tb.hosts[1], tb.hosts[2]]
    job = f"ezpart-{secrets.token_hex(4)}"
    launcher, out, log = _start(tmp_path, hosts, job, "--master-port", str(free_port()))
    try:
        _world_of_two(launcher, out, log)
        with partition(tb, 1, 2):
            t_cut = time.time()
            again = lambda: [r for r in reports(out) if r["world_size"] == 1 and r["time"] > t_cut]  # noqa: E731
            wait_for(again, 60, "the survivor training at world 1")
            recovery = min(r["time"] for r in again()) - t_cut
            line = "the c10d rendezvous store at"
            try:
                wait_for(lambda: line in log.read_text(), 60, "the cut-off node's line")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{log.read_text()[-6000:]}") from None
            # its workers are stopped; its agent (one process of the job) stays
            cut_off = lambda: len(leftovers(job, tb).get(hosts[1], [])) == 1  # noqa: E731
            wait_for(cut_off, 30, f"only the agent of the job left on {hosts[1]}")
        t_heal = time.time()
        print(f"partition: the survivor trains again {recovery:.2f} s after the cut")
        back = lambda: [r for r in reports(out) if r["world_size"] == 2 and r["time"] > t_heal]  # noqa: E731
        wait_for(lambda: len(back()) == 2, 90, "world 2 again after the heal")
        rejoined = min(r["time"] for r in back()) - t_heal
        print(f"partition: world 2 again {rejoined:.2f} s after the heal")
        text = _stop(launcher, out, log, job, tb)
        assert f"{hosts[1]}: elasticzero-run: {line}" in text and "tries to join the rendezvous again" in text, text
        # the agents' part (silent for the peer timeout, stop, the round's last call) plus one worker start-up, whose
        # reference is this machine's, measured in this run (the world-2 workers' start -> report), x1.5 for the noise
        # of one process start against another; the 10 s is what it comes to on a quiet machine: printed
        startup = max(r["time"] - r["started"] for r in reports(out) if r["world_size"] == 2 and r["time"] < t_cut)
        bound = DEFAULT_PEER_TIMEOUT_S + int(RDZV_DEFAULTS["last_call_timeout"]) + agents_slack(startup) + 1.5 * startup
        print(f"partition: bound {bound:.2f} s (start-up {startup:.2f} s); the issue's {RECOVERY_S:.0f} s "
              f"{'met' if recovery < RECOVERY_S else 'MISSED'}")  # fmt: skip
        assert recovery < bound, f"{recovery:.1f} s > {bound:.1f} s (peer timeout {DEFAULT_PEER_TIMEOUT_S} s)"
        # back at world 2 within the same: the cut-off node's next try (1 s apart), a rendezvous round, the workers'
        # restart (the issue: the peer timeout + a rendezvous round after the link returns)
        assert rejoined < bound, f"{rejoined:.1f} s after the heal > {bound:.1f} s"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_job(job)


@pytest.mark.etcd
def test_the_first_host_cut_off_from_an_etcd_job_rejoins_and_the_job_trains_on(tmp_path: Path) -> None:
    """The etcd route (issue 33): etcd in the root namespace, node rank 0 — the host that would have held the c10d
    store — loses its link. The other node trains on at world 1; node 0's store calls fail after the etcd client's
    bound (``retry_timeout``), it stops its workers and keeps trying, and when the link is back it joins again."""
    tb = ez_testing.testbed()
    require_program("pdsh")
    require(len(tb.hosts) >= 3, "the partition tests use hosts 2 and 3 of the test bed (1 and 2 serve other tests)")
    hosts = [tb.hosts[1], tb.hosts[2]]
    cluster = EtcdCluster.start(tmp_path / "etcd", 1, require_etcd("3.4"), host=tb.head_addr)
    try:
        _cut_node0_of_an_etcd_job(tb, hosts, cluster, tmp_path)
    finally:
        cluster.stop()


def _cut_node0_of_an_etcd_job(tb: ez_testing.Testbed, hosts: list[str], cluster: EtcdCluster, tmp_path: Path) -> None:
    job = f"ezpart-etcd-{secrets.token_hex(4)}"
    flags = ["--rdzv-endpoint", cluster.endpoint(), "--rdzv-conf", "retry_timeout=5,connect_timeout=3"]
    launcher, out, log = _start(tmp_path, hosts, job, *flags, "--rejoin-timeout", "120")
    try:
        _world_of_two(launcher, out, log)
        node0_worker = next(r["pid"] for r in reports(out) if netns_of(r["pid"]) == tb.netns[1])  # the host cut
        with link_down(tb, 1):  # node rank 0
            t_cut = time.time()
            on = lambda: [r for r in reports(out) if r["world_size"] == 1 and r["time"] > t_cut]  # noqa: E731
            wait_for(on, 60, "the other node training at world 1")
            # the path under test, seen from here (its lines reach the launcher only over the cut link): its store
            # calls failed past retry_timeout and it stopped its worker while cut off — not a fixed wait, which a
            # loaded machine overran (then it learnt after the heal that it had been dropped: the other path)
            gone = lambda: not psutil.pid_exists(node0_worker)  # noqa: E731
            wait_for(gone, 60, "the cut-off node stopping its worker (its store calls failed past retry_timeout)")
        t_heal = time.time()
        print(f"etcd partition: node 1 trains on {min(r['time'] for r in on()) - t_cut:.2f} s after node 0's cut")
        back = lambda: [r for r in reports(out) if r["world_size"] == 2 and r["time"] > t_heal]  # noqa: E731
        wait_for(lambda: len(back()) == 2, 120, "world 2 again after the heal", lambda: log.read_text()[-4000:])
        print(f"etcd partition: world 2 again {min(r['time'] for r in back()) - t_heal:.2f} s after the heal")
        text = _stop(launcher, out, log, job, tb)
        assert f"{hosts[0]}: elasticzero-run: " in text and "tries to join the rendezvous again" in text, text[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_job(job)
