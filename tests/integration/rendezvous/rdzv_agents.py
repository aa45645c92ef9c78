"""Start real ``torchrun`` agents as separate processes ("nodes" on loopback) and reap them, by pid only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("rdzv_worker.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


@dataclass
class Agent:
    """One torchrun process (its own session, so its whole tree can be signalled by its pid's group)."""

    proc: subprocess.Popen[str]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def torchrun_argv(
    endpoint: str,
    run_id: str,
    nnodes: str,
    out_dir: Path,
    *,
    rdzv_conf: Sequence[str] = (),
    local_addr: str | None = None,
    sleep_s: float = 0.0,
    nproc: int = 1,
) -> list[str]:
    """argv of one torchrun agent using the ``elasticzero`` rendezvous."""
    argv = [
        str(TORCHRUN),
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=elasticzero",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--max-restarts=0",
        "--monitor-interval=0.2",
    ]
    if rdzv_conf:
        argv.append("--rdzv-conf=" + ",".join(rdzv_conf))
    if local_addr:
        argv.append(f"--local-addr={local_addr}")
    return [*argv, str(WORKER), str(out_dir), str(sleep_s)]


def start_agent(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Agent:
    """Start one agent with stdout+stderr to ``log``."""
    # faulthandler: a hung agent is sent SIGABRT before the kill and prints every thread's stack into its log
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            list(argv), stdout=f, stderr=subprocess.STDOUT, env=full_env, start_new_session=True, text=True
        )
    return Agent(proc, log)


def wait_all(agents: Sequence[Agent], timeout: float) -> list[int]:
    """Wait for every agent; on timeout kill them all and raise with their logs."""
    deadline = time.monotonic() + timeout
    codes = []
    for agent in agents:
        try:
            codes.append(agent.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            dump_stacks(agents)
            kill_agents(agents)
            logs = "\n".join(f"--- {a.log.name}\n{a.output()[-3000:]}" for a in agents)
            raise AssertionError(f"torchrun agents did not finish within {timeout}s\n{logs}") from None
    return codes


def dump_stacks(agents: Sequence[Agent]) -> None:
    """SIGABRT each live agent (not its workers): faulthandler writes all its threads' stacks to the log."""
    for agent in agents:
        if agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGABRT)
            try:
                agent.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def kill_agents(agents: Sequence[Agent]) -> None:
    """SIGKILL each agent's process group (the group id is the pid we started) and reap it."""
    for agent in agents:
        if agent.proc.poll() is None:
            try:
                os.killpg(agent.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            agent.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@contextmanager
def agents_reaped() -> Iterator[list[Agent]]:
    """A list to put started agents in; all of them are killed and reaped on exit."""
    agents: list[Agent] = []
    try:
        yield agents
    finally:
        kill_agents(agents)


def wait_for_files(paths: Sequence[Path], timeout: float, agents: Sequence[Agent] = ()) -> None:
    """Wait until every path exists (e.g. the workers' ``started<rank>`` markers); fail with the agents' logs."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or any(a.proc.poll() not in (None, 0) for a in agents):
            logs = "\n".join(f"--- {a.log.name}\n{a.output()[-3000:]}" for a in agents)
            raise AssertionError(f"not all of {[p.name for p in paths]} appeared within {timeout}s\n{logs}")
        time.sleep(0.1)


def read_records(out_dir: Path, world_size: int) -> list[dict[str, object]]:
    """The per-rank JSON records written by ``rdzv_worker.py``, by global rank."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
