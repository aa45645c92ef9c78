"""Stress: a job that was scaled up by a join ends — every agent exits 0 within seconds (a script, not collected).

Each run: two agents (``--nnodes 2:3``, one gloo worker each, all-reducing every 0.1 s) form a world of 2, a third
agent joins (world 3), the job runs on for a random 0 to ``--max-run`` seconds, then every worker stops (exit 0).
A run is *bad* when an agent has not exited ``--linger`` seconds after the stop or exits non-zero; a lingering agent
is sent SIGABRT first (the agents run with ``PYTHONFAULTHANDLER=1``, so every thread's stack lands in its log) and
the logs are kept. ``--burn N`` adds N CPU-bound processes (the loaded machine); ``--spread S`` makes each worker
wait a random 0..S seconds after the stop before it exits (nodes finish at different moments, as a real job's do).

    .venv/bin/python tests/stress/finish_stress.py --runs 20 --burn 2

Prints one line per run (each agent's exit time after the stop, and its code) and a summary.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "integration" / "agent")]

from ez_agentkit import Agent, Cluster, wait_for  # noqa: E402

from ez_testing import free_port  # noqa: E402

WORLD_TIMEOUT = 150.0
Exit = tuple[float, int] | None  # seconds after the stop, exit code; None: still running


def burn() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % (1 << 31)


def world(cluster: Cluster, size: int, since: float) -> None:
    wait_for(lambda: len(cluster.reports_since(since, size)) == size, WORLD_TIMEOUT, f"world {size}", cluster.agents)


def grow_to_three(cluster: Cluster, spread: float = 0.0) -> None:
    """Two agents form a world of 2; a third joins; wait for the world of 3."""
    endpoint = f"127.0.0.1:{free_port()}"
    argv = cluster.argv(endpoint, "2:3", nproc=1, worker_opts=["loop=1", f"exit_spread={spread}"])
    env = {"PYTHONFAULTHANDLER": "1"}
    cluster.start(argv, env)
    cluster.wait_store(endpoint, WORLD_TIMEOUT)
    cluster.start(argv, env)
    world(cluster, 2, 0)
    t = time.time()
    cluster.start(argv, env)
    world(cluster, 3, t)


def exit_times(agents: list[Agent], linger: float) -> list[Exit]:
    """Each agent's (seconds after now, exit code), polled until all exited or ``linger`` seconds passed."""
    start = time.monotonic()
    exits: list[Exit] = [None] * len(agents)
    while None in exits and time.monotonic() - start < linger:
        for i, agent in enumerate(agents):
            if exits[i] is None and agent.proc.poll() is not None:
                exits[i] = (round(time.monotonic() - start, 2), agent.proc.returncode)
        time.sleep(0.05)
    return exits


def keep_stacks(cluster: Cluster, keep: Path, run: int) -> None:
    """SIGABRT every agent still running (faulthandler dumps its threads), then keep all agents' logs."""
    for agent in cluster.agents:
        if agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGABRT)
    time.sleep(2)
    for i, agent in enumerate(cluster.agents):
        (keep / f"run{run}-agent{i}.log").write_text(agent.output())


def one_run(run: int, keep: Path, max_run: float, linger: float, rng: random.Random, spread: float) -> bool | None:
    """One run; True when every agent exited 0 within ``linger`` seconds of the stop (None: no world of 3 formed)."""
    cluster = Cluster(Path(tempfile.mkdtemp(dir=keep)))
    try:
        try:
            grow_to_three(cluster, spread)
        except AssertionError as exc:  # the world did not form: a run that proves nothing about the exit
            print(f"run {run}: no world of 3 ({str(exc).splitlines()[0]}); not counted", flush=True)
            return None
        time.sleep(rng.uniform(0, max_run))
        (cluster.out / "stop").touch()
        exits = exit_times(cluster.agents, linger + spread)
        good = all(e is not None and e[1] == 0 for e in exits)
        print(f"run {run}: exits after the stop (s, code): {exits}{'' if good else '  <-- BAD, logs kept'}", flush=True)
        if not good:
            keep_stacks(cluster, keep, run)
        return good
    finally:
        cluster.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--linger", type=float, default=20.0, help="seconds after the stop before a run counts as bad")
    ap.add_argument("--max-run", type=float, default=2.0, help="the job runs 0 to this many seconds at world 3")
    ap.add_argument("--burn", type=int, default=0, help="CPU-bound processes beside the job")
    ap.add_argument("--spread", type=float, default=0.0, help="each worker exits 0..SPREAD s after the stop")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rng = random.Random(args.seed)
    keep = Path(tempfile.mkdtemp(prefix="ez-finish-"))
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burn)]
    for b in burners:
        b.start()
    try:
        results = [one_run(i, keep, args.max_run, args.linger, rng, args.spread) for i in range(args.runs)]
    finally:
        for b in burners:
            b.terminate()
    bad = results.count(False)
    counted = len(results) - results.count(None)
    print(f"runs={counted} (of {args.runs} started) bad={bad} load={os.getloadavg()} logs of bad runs: {keep}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
