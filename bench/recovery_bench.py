"""Recovery time after an agent dies: ``elasticzero-run`` vs plain ``torchrun``, same timeouts, side by side.

    .venv/bin/python bench/recovery_bench.py [--reps 3] [--scenarios agent-kill,node-loss]

Each run starts 3 agents as separate processes on 127.0.0.1 (``--nnodes 2:3``, 1 gloo worker each, the workers
all_reduce every 0.1 s and write a report after the first all_reduce of every (re)start), waits for the world of 3,
then SIGKILLs the third agent and measures the time until both survivors' workers have completed an all_reduce in
a world of 2 ("running again"). Scenarios:

* ``agent-kill`` — SIGKILL of the agent process only (what the brief asks). torchrun's workers run in their own
  session with no parent-death signal, so the dead agent's worker lives on as an orphan, the old world keeps
  going and the survivors never re-rendezvous: reported as "no recovery" within ``--cap`` seconds.
* ``node-loss`` — SIGKILL of the agent and its worker at the same instant (a machine dying): the fair comparison
  of the rendezvous path itself.

Both tools get the same ``--rdzv-conf`` (default: elasticzero-run's built-in defaults, so elasticzero-run runs
"at default settings" and torchrun with the same timeouts). Runs alternate tool by tool; medians and the ratio
torchrun / elasticzero-run are printed. Not a test: numbers depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from elasticzero.agent.options import RDZV_DEFAULTS
from elasticzero.agent.proctree import descendants, kill_now, processes_with_env

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ez_ports import free_port  # tests/ on sys.path: the one free-port rule of tests and benchmarks

BIN = Path(sys.executable).parent
WORKER_SRC = """
import json, os, sys, time
import torch, torch.distributed as dist
out = sys.argv[1]
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rep = {"pid": os.getpid(), "rank": dist.get_rank(), "world_size": dist.get_world_size(), "time": time.time()}
with open(os.path.join(out, f".r{os.getpid()}"), "w") as f:
    json.dump(rep, f)
os.replace(os.path.join(out, f".r{os.getpid()}"), os.path.join(out, f"report.{os.getpid()}.json"))
flag = torch.zeros(1)
while True:
    flag.fill_(1.0 if os.path.exists(os.path.join(out, "stop")) else 0.0)
    dist.all_reduce(flag)
    if flag.item() > 0:
        break
    time.sleep(0.1)
"""


TOOLS = ("elasticzero", "torchrun", "torchrun-fresh-store")


def agent_argv(tool: str, endpoint: str, job: str, conf: str, worker: Path, out: Path) -> list[str]:
    prog = "elasticzero-run" if tool == "elasticzero" else "torchrun"
    argv = [str(BIN / prog), "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-id", job, "--max-restarts", "3", "--rdzv-conf", conf]
    return [*argv, str(worker), str(out)]


def reports(out: Path) -> list[dict[str, float]]:
    return [json.loads(p.read_text()) for p in out.glob("report.*.json")]


def wait_until(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def respawned(agents: list[subprocess.Popen[bytes]], t_kill: float) -> float | None:
    """Latest (over survivors) creation time of a worker started after ``t_kill``, or None if one has none yet."""
    times = []
    for a in agents:
        try:
            new = [c.create_time() for c in psutil.Process(a.pid).children() if c.create_time() > t_kill]
        except psutil.Error:
            return None
        if not new:
            return None
        times.append(min(new))
    return max(times)


def one_run(tool: str, scenario: str, conf: str, worker: Path, cap: float) -> tuple[float | None, float | None]:
    """Seconds from the kill to (survivors' workers respawned, their first all_reduce at world size 2)."""
    tmp = Path(tempfile.mkdtemp(prefix="ez-recovery-"))
    out = tmp / "out"
    out.mkdir()
    job = f"ezbench-{uuid.uuid4().hex[:8]}"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTICZERO_JOB_ID": job}  # tag torchrun's processes too
    if tool == "torchrun-fresh-store":  # what elasticzero-run sets: no TCPStore shared across rounds
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(3):
            with (tmp / f"agent{i}.log").open("wb") as log:
                argv = agent_argv(tool, endpoint, job, conf, worker, out)
                agents.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True))
            if i == 0:  # the first agent hosts the c10d store; it is never the one killed
                wait_until(lambda: _listening(endpoint), 60)
        if not wait_until(lambda: sum(r["world_size"] == 3 for r in reports(out)) == 3, 180):
            raise RuntimeError(f"{tool}: no world of 3 formed; see {tmp}")
        victim = agents[2]
        victim_tree = descendants([victim.pid])
        t_kill = time.time()
        if scenario == "node-loss":
            kill_now(victim_tree)
        else:
            victim.send_signal(signal.SIGKILL)
        survivors = agents[:2]
        spawn: list[float] = []
        ok = wait_until(
            lambda: (
                (spawn or _note(spawn, respawned(survivors, t_kill)))
                and sum(r["world_size"] == 2 and r["time"] > t_kill for r in reports(out)) >= 2
            ),
            cap,
        )
        t_spawn = spawn[0] - t_kill if spawn else None
        if not ok:
            return t_spawn, None
        return t_spawn, max(r["time"] for r in reports(out) if r["world_size"] == 2 and r["time"] > t_kill) - t_kill
    finally:
        (out / "stop").touch()
        leftovers = descendants(a.pid for a in agents) + processes_with_env("ELASTICZERO_JOB_ID", job)
        leftovers += [psutil.Process(int(r["pid"])) for r in reports(out) if psutil.pid_exists(int(r["pid"]))]
        kill_now(leftovers)
        for a in agents:
            a.wait(timeout=10)


def _note(spawn: list[float], value: float | None) -> bool:
    if value is not None:
        spawn.append(value)
    return False


def _listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False


def fmt(v: float | None, cap: float) -> str:
    return f"{v:5.1f}s" if v is not None else f">{cap:.0f}s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenarios", default="agent-kill,node-loss")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--rdzv-conf", default=",".join(f"{k}={v}" for k, v in RDZV_DEFAULTS.items()))
    p.add_argument("--cap", type=float, default=45.0, help="give up waiting for recovery after this many seconds")
    args = p.parse_args()
    worker = Path(tempfile.mkdtemp(prefix="ez-recovery-w-")) / "worker.py"
    worker.write_text(WORKER_SRC)
    tools = args.tools.split(",")
    print(f"rdzv-conf for every tool: {args.rdzv_conf}; 3 agents x 1 gloo worker, SIGKILL agent 3, {args.reps} reps")
    print("times from the kill: respawn = survivors' new workers started; ready = their first all_reduce at size 2")
    for scenario in args.scenarios.split(","):
        results: dict[str, list[tuple[float | None, float | None]]] = {t: [] for t in tools}
        for rep in range(args.reps):
            for tool in tools:
                spawn, ready = one_run(tool, scenario, args.rdzv_conf, worker, args.cap)
                results[tool].append((spawn, ready))
                times = f"respawn {fmt(spawn, args.cap)}  ready {fmt(ready, args.cap)}"
                print(f"  {scenario:10s} rep {rep + 1} {tool:21s} {times}", flush=True)
        med = {
            t: (_median([v[0] for v in r], args.cap), _median([v[1] for v in r], args.cap)) for t, r in results.items()
        }
        for tool in tools:
            spawn_m, ready_m = med[tool]
            line = f"{scenario}: {tool:21s} median respawn {fmt(spawn_m, args.cap)} ready {fmt(ready_m, args.cap)}"
            base = med.get("elasticzero", (None, None))[1]
            if tool != "elasticzero" and base:
                ratio = (ready_m if ready_m is not None else args.cap) / base
                line += f"  ratio ready {tool}/elasticzero-run = {'>=' if ready_m is None else ''}{ratio:.2f}"
            print(line, flush=True)
    return 0


def _median(values: list[float | None], cap: float) -> float | None:
    """Median, counting a run that did not recover as ``cap``; None when the median run did not recover."""
    med = statistics.median(cap if v is None else v for v in values)
    return None if med >= cap else med


if __name__ == "__main__":
    sys.exit(main())
