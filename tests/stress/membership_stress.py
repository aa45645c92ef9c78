"""Stress: scale-up and scale-down must never fail a job (a script, not collected by pytest: no ``test_`` files here).

One job of two agents (``--nnodes 2:3``, ``--max-restarts 0``, one gloo worker each, all-reducing every 0.1 s) lives
through repeated cycles: a third agent joins (scale-up: world 2 → 3), then is stopped with SIGTERM (scale-down:
3 → 2). With ``--max-restarts 0`` any membership change counted as a failure ends the job, so a *job failure* is:
an agent of the job exits, the new world does not form in time, or any worker reports a restart count ≠ 0. After a
failure the logs are kept and a fresh job continues the count. A random delay (0 to 1.5 s) before each change varies
the interleaving with the workers' collectives and the agents' monitor ticks.

    .venv/bin/python tests/stress/membership_stress.py --cycles 30 --budget-min 25

Prints one line per change and a summary (runs and failures per scenario, wall time, load average).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "integration" / "agent")]

from ez_agentkit import Agent, Cluster  # noqa: E402

from ez_testing import free_port  # noqa: E402

WORLD_TIMEOUT = 150.0


class JobFailed(Exception):
    """The job did not survive a membership change."""


class Job:
    """Two long-lived agents plus the one that comes and goes."""

    def __init__(self, tmp: Path) -> None:
        self.cluster = Cluster(tmp)
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.core: list[Agent] = []
        self.guest: Agent | None = None

    def start(self) -> None:
        for i in range(2):
            self.core.append(self._agent())
            if i == 0:
                self.cluster.wait_store(self.endpoint)
        self.world(2, 0)

    def _agent(self) -> Agent:
        return self.cluster.start(self.cluster.argv(self.endpoint, "2:3", nproc=1, worker_opts=["loop=1"]))

    def world(self, size: int, since: float) -> None:
        """Wait for ``size`` fresh workers (all at restart count 0) while every core agent stays alive."""
        deadline = time.monotonic() + WORLD_TIMEOUT
        while time.monotonic() < deadline:
            dead = [(i, a.proc.poll()) for i, a in enumerate(self.core) if a.proc.poll() is not None]
            if dead:
                raise JobFailed(f"core agent(s) exited: {dead}")
            reports = self.cluster.reports_since(since, size)
            counts = {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in self.cluster.reports_since(since)}
            if counts - {"0"}:
                raise JobFailed(f"a restart was spent: restart counts {sorted(counts)}")
            if len(reports) == size:
                return
            time.sleep(0.1)
        raise JobFailed(f"no world of {size} within {WORLD_TIMEOUT:.0f}s")

    def scale_up(self) -> float:
        t = time.time()
        self.guest = self._agent()
        self.world(3, t)
        return time.time() - t

    def scale_down(self) -> float:
        assert self.guest is not None
        t = time.time()
        self.guest.proc.send_signal(signal.SIGTERM)
        code = self.guest.proc.wait(timeout=60)
        if code != 128 + signal.SIGTERM:
            raise JobFailed(f"the leaving agent exited {code}, not {128 + signal.SIGTERM}")
        self.guest = None
        self.world(2, t)
        return time.time() - t

    def finish(self) -> None:
        (self.cluster.out / "stop").touch()
        codes = [a.proc.wait(timeout=90) for a in self.core]
        if codes != [0, 0]:
            raise JobFailed(f"the job did not end cleanly: exit codes {codes}")

    def logs(self) -> str:
        return "\n".join(f"--- agent {i} ---\n{a.output()[-4000:]}" for i, a in enumerate(self.cluster.agents))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=30, help="scale-up + scale-down cycles (each counts one of each)")
    ap.add_argument("--budget-min", type=float, default=25.0, help="stop starting new cycles after this many minutes")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rng = random.Random(args.seed)
    runs = {"scale-up": 0, "scale-down": 0}
    failures = {"scale-up": 0, "scale-down": 0}
    start, load0 = time.monotonic(), os.getloadavg()
    keep = Path(tempfile.mkdtemp(prefix="ez-stress-"))
    job: Job | None = None
    cycle = 0
    try:
        while cycle < args.cycles and time.monotonic() - start < args.budget_min * 60:
            if job is None:
                job = Job(Path(tempfile.mkdtemp(dir=keep)))
                job.start()
            cycle += 1
            for name, step in (("scale-up", job.scale_up), ("scale-down", job.scale_down)):
                time.sleep(rng.uniform(0, 1.5))
                runs[name] += 1
                try:
                    took = step()
                    print(f"cycle {cycle:3d} {name:<10} ok   {took:5.1f}s", flush=True)
                except JobFailed as exc:
                    failures[name] += 1
                    print(f"cycle {cycle:3d} {name:<10} FAIL {exc}\n{job.logs()}", flush=True)
                    job.cluster.cleanup()
                    job = None
                    break
        if job is not None:
            job.finish()
    except JobFailed as exc:
        print(f"job end FAIL {exc}", flush=True)
        failures["scale-down"] += 1
    finally:
        if job is not None:
            job.cluster.cleanup()
    wall = time.monotonic() - start
    for name in runs:
        print(f"{name:<10}: {runs[name]} runs, {failures[name]} job failures")
    print(f"wall {wall / 60:.1f} min; load average at start {load0[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    print(f"logs kept under {keep}")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
