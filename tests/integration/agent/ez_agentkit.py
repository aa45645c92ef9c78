"""Start real ``elasticzero-run`` agents as separate processes ("nodes" on loopback), watch them, reap them.

Cleanup is scoped: the pids we started, their descendants, and processes carrying this test's unique
``ELASTICZERO_JOB_ID``. Nothing is matched by command line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elasticzero.agent.agentdirs import sweep
from elasticzero.agent.proctree import descendants, kill_now, processes_with_env, signal_all

WORKER = Path(__file__).with_name("ez_agent_worker.py")
ELASTICZERO_RUN = Path(sys.executable).with_name("elasticzero-run")

#: short rendezvous timeouts so faults resolve in seconds
FAST_RDZV = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4,close_timeout=10"


@dataclass
class Agent:
    """One elasticzero-run process (own session) and its log file."""

    proc: subprocess.Popen[bytes]
    log: Path
    health: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.health.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


@dataclass
class Cluster:
    """Agents of one job; ``job_id`` is unique per test."""

    tmp: Path
    job_id: str = field(default_factory=lambda: f"ezt-{uuid.uuid4().hex[:10]}")
    agents: list[Agent] = field(default_factory=list)

    @property
    def out(self) -> Path:
        path = self.tmp / "out"
        path.mkdir(exist_ok=True)
        return path

    def argv(
        self,
        endpoint: str,
        nnodes: str,
        *,
        node_table: str | None = None,
        identity: Sequence[str] = (),
        nproc: int | None = None,
        backend: str = "c10d",
        rdzv_conf: str = FAST_RDZV,
        max_restarts: int = 0,
        extra: Sequence[str] = (),
        worker_opts: Sequence[str] = (),
        health: Path | None = None,
    ) -> list[str]:
        argv = [str(ELASTICZERO_RUN), "--nnodes", nnodes, "--rdzv-backend", backend, "--rdzv-endpoint", endpoint]
        argv += ["--rdzv-id", self.job_id, "--max-restarts", str(max_restarts), "--monitor-interval", "0.2"]
        if rdzv_conf:
            argv += ["--rdzv-conf", rdzv_conf]
        if node_table is not None:
            argv += ["--node-table", node_table]
        if nproc is not None:
            argv += ["--nproc-per-node", str(nproc)]
        if health is not None:
            argv += ["--health-file", str(health)]
        return [*argv, *identity, *extra, str(WORKER), str(self.out), *worker_opts]

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> Agent:
        """Start one agent in its own session (``env``: extra variables on top of ours)."""
        i = len(self.agents)
        log = self.tmp / f"agent{i}.log"
        health = Path(argv[argv.index("--health-file") + 1]) if "--health-file" in argv else self.tmp / "none"
        with log.open("wb") as fh:
            full_env = {**os.environ, **env} if env else None
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=full_env)
        agent = Agent(proc, log, health)
        self.agents.append(agent)
        return agent

    def reports(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.out.glob("report.*.json")):
            out.append(json.loads(path.read_text()))
        return out

    def reports_since(self, t: float, world_size: int | None = None) -> list[dict[str, Any]]:
        """Reports written after wall-clock time ``t`` (optionally only those of a given world size)."""
        return [r for r in self.reports() if r["time"] > t and (world_size is None or r["world_size"] == world_size)]

    def wait_store(self, endpoint: str, timeout: float = 120) -> None:
        """Wait until the first agent's TCPStore listens on ``endpoint`` (so it, not a later agent, hosts it)."""
        host, port = endpoint.rsplit(":", 1)

        def listening() -> bool:
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                return True
            except OSError:
                return False

        wait_for(listening, timeout, f"rendezvous store on {endpoint}", self.agents)

    def cleanup(self) -> None:
        procs = descendants(a.proc.pid for a in self.agents)
        procs += processes_with_env("ELASTICZERO_JOB_ID", self.job_id)
        for r in self.reports():
            if r.get("grandchild"):
                procs += descendants([r["grandchild"]])
        signal_all(procs, signal.SIGCONT)  # continue what a test stopped (SIGSTOP), so that nothing holds up the kill
        kill_now(procs)
        for a in self.agents:
            if a.proc.poll() is None:
                a.proc.kill()
            a.proc.wait(timeout=10)
        sweep(os.environ, self.job_id)  # the folders a SIGKILLed agent of the test left

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this job still alive (zombies excluded)."""
        alive = []
        for p in processes_with_env("ELASTICZERO_JOB_ID", self.job_id):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                continue
        return alive


def wait_for(pred: Callable[[], Any], timeout: float, what: str, agents: Sequence[Agent] = ()) -> Any:
    """Poll ``pred`` until truthy; on timeout fail with ``what`` and the agents' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    logs = "\n".join(f"--- agent {i} ---\n{a.output()[-3000:]}" for i, a in enumerate(agents))
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
