"""Hung workers on live nodes: the agent names the hung rank, dumps its stacks, and the job trains again from the
newest checkpoint within the hang timeout plus 10 s (:func:`trained_again`), every sample once (docs/agent.md, "Hung
workers").

The example job (``train_driver.py``: ``examples/train_gpt.py`` with the test hooks, ZeRO-2 on gloo) under real
``elasticzero-run`` agents with ``--hang-timeout`` short enough for a test:

- ``sleep``: two agents, one worker each; rank 1 stops making progress before step 5 (it sleeps in its loop, the
  driver's ``--hang-at``) while rank 0 goes on into step 5's collectives and waits there. Rank 1's agent names it
  (outside the engine's collectives) and its stacks are in the log; rank 0's agent, whose worker waits in an engine
  collective, leaves it to that agent (it does not name rank 0);
- ``sigstop``: one agent, two workers; rank 1's process is SIGSTOPped (only it: the agent and rank 0 run on). The
  agent names it as stopped (no stacks: a stopped process cannot dump them).

Either way the restart is spent (the health file's ``restart_count``), the new attempt resumes from step 3 (the
checkpoint before the hang), the sample record covers every step's batch once, and no process is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from ez_agentkit import ELASTICZERO_RUN, FAST_RDZV, Cluster, wait_for

from elasticzero.agent.hang import DUMP_WAIT_S
from elasticzero.data import ByteCorpus, epoch_order, stdlib_corpus
from ez_testing import agents_slack, free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.clock, pytest.mark.timeout(180)]

DRIVER = Path(__file__).with_name("train_driver.py")
STEPS, GLOBAL, SEQ, CORPUS, SEED, SAVE, HANG_AT = 8, 8, 32, 4_700, 3, 3, 5
HANG_TIMEOUT = 4.0  # seconds; a step of this job takes well under 0.5 s on a loaded 2-core machine
RESUME = HANG_AT - 1 - (HANG_AT - 1) % SAVE  # the newest checkpoint when step HANG_AT stalls
CONFIG = "zero: {stage: 2}\noptimizer: {type: AdamW, params: {lr: 2.0e-3}}\ntrain_batch_size: 8\nmicro_batch_size: 2\n"
MONITOR_S = 0.2  # the agents' --monitor-interval
#: the timers of the agents' part of a hang's recovery: the timeout, the stacks' wait, two monitor ticks (the hung
#: worker's agent finds the timeout passed at its tick; its peer finds a node waiting at its own) and the
#: re-rendezvous' last call (FAST_RDZV: 1 s); the kill, the process exits and the spawn come on top
#: (``ez_testing.agents_slack``: 0.7-1.9 s on a quiet machine, 2.1-2.6 s at CI's load)
AGENTS_S = HANG_TIMEOUT + DUMP_WAIT_S + 2 * MONITOR_S + 1.0
WAIT = 120.0  # seconds to wait for any one phase before failing (a broken run, not a measurement)


def argv(cluster: Cluster, endpoint: str, nnodes: int, nproc: int, index: int, hang: list[str]) -> list[str]:
    tmp = cluster.tmp
    (tmp / "job.yaml").write_text(CONFIG)
    agent = [str(ELASTICZERO_RUN), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
    agent += ["--rdzv-endpoint", endpoint, "--rdzv-id", cluster.job_id, "--rdzv-conf", FAST_RDZV]
    agent += ["--max-restarts", "3", "--monitor-interval", str(MONITOR_S), "--hang-timeout", str(HANG_TIMEOUT)]
    agent += ["--health-file", str(tmp / f"health{index}.json")]
    job = ["--config", str(tmp / "job.yaml"), "--size", "tiny", "--seq-len", str(SEQ), "--steps", str(STEPS)]
    job += ["--corpus-bytes", str(CORPUS), "--cache-dir", str(tmp / "corpus"), "--seed", str(SEED)]
    job += ["--save-every", str(SAVE), "--checkpoint-dir", str(tmp / "ckpt")]
    job += ["--record-samples", str(tmp / "record.jsonl"), "--hold-file", str(tmp / "hold")]
    return [*agent, str(DRIVER), *job, *hang]


def records(cluster: Cluster) -> list[dict]:
    path = cluster.tmp / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def attempts(cluster: Cluster) -> dict[int, dict[int, list[dict]]]:
    """Per attempt (in start order), per step, the ranks' records."""
    out: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records(cluster):
        out[r["attempt"]][r["step"]].append(r)
    return dict(sorted(out.items()))


def retrained(cluster: Cluster, since: float) -> dict | None:
    """The first step record of an attempt that started after ``since`` (wall clock), when every rank has one."""
    for steps in attempts(cluster).values():
        first = steps[min(steps)]
        if first[0]["started"] > since and len(first) == first[0]["world"]:
            return max(first, key=lambda r: r["time"])
    return None


def check_exactly_once(cluster: Cluster) -> None:
    """The last attempt at each step trained exactly that step's global batch; lost attempts only at redone steps."""
    n = len(ByteCorpus(stdlib_corpus(cluster.tmp / "corpus", "train", max_bytes=CORPUS), SEQ))
    order = epoch_order(n, SEED, 0).tolist()
    by_step: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records(cluster):
        by_step[r["step"]][r["attempt"]].append(r)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for step, tries in by_step.items():
        last = tries[max(tries)]
        assert Counter(i for r in last for _, i in r["samples"]) == Counter(order[(step - 1) * GLOBAL : step * GLOBAL])
        assert sorted(r["rank"] for r in last) == [0, 1], step
    redone = sorted(s for s, tries in by_step.items() if len(tries) > 1)
    assert redone == list(range(RESUME + 1, HANG_AT)), redone  # done before the hang, lost with it, done again


def trained_again(cluster: Cluster, first: dict, since: float, what: str) -> None:
    """Assert the new attempt's first step came in time after ``since`` (the hang), printed with its parts (the new
    workers' process start, their start-up to the attempt id broadcast after the checkpoint load, the first step).

    The issue's figure is "the hang timeout plus 10 s" (met on a quiet 2-core machine: 9.4 s and 7.2 s), of which the
    workers' start-up (interpreter, torch import, process group, model build, checkpoint load) is 3.5-4 s there and
    2-3 times that on a loaded one. So, as in test_freeze.py, the bound is the agents' part (the hang timeout, the
    stacks' wait, two monitor ticks and the re-rendezvous' last call: ``AGENTS_S``, and the agents' own work:
    ``agents_slack``) plus 1.5 x the start-up
    the *first* attempt's workers took in this same run (the noise of one process start against another), plus what
    the first attempt did not do: the new attempt's checkpoint load and first step; whether the issue's 10 s was met is
    printed.
    """
    took, ready = first["time"] - since, first["attempt"] / 1e9
    restart, start = first["started"] - since, ready - first["started"]
    # the slowest of the first attempt's ranks, as test_freeze.py takes it: the restarted pair starts together and
    # contends for the cores (measured 1.8x the quickest first-attempt start at load 5); the first attempt's slowest
    # waited for its peer's later start instead
    startup = max(r["attempt"] / 1e9 - r["started"] for r in records(cluster) if r["resumed"] == 0)
    # + the new attempt's own checkpoint load and first step (the first attempt loaded nothing)
    agents = AGENTS_S + agents_slack(startup)
    bound = agents + 1.5 * startup + first["load_s"] + (first["time"] - ready)
    met = "met" if took <= HANG_TIMEOUT + 10 else "NOT met (start-up bound: machine load)"
    print(f"{what} -> first step of the new attempt: {took:.1f}s = restart {restart:.1f}s + worker start {start:.1f}s"
          f" + step {first['time'] - ready:.1f}s; bound {bound:.1f}s (first attempt's start-up {startup:.1f}s, "
          f"checkpoint load {first['load_s']:.1f}s); "
          f"hang timeout + 10 s {met}")  # fmt: skip
    assert restart < agents, (restart, agents)
    assert took < bound, (took, bound)


def hang_lines(cluster: Cluster) -> list[tuple[int, str]]:
    """(agent index, line) of every agent's hang line."""
    return [
        (i, m.group(0))
        for i, a in enumerate(cluster.agents)
        for m in re.finditer(r"elasticzero-run: hang: .*", a.output())
    ]


def worker_pid(cluster: Cluster, index: int, rank: int) -> int:
    state = wait_for(lambda: cluster.agents[index].state(), WAIT, "the health file", cluster.agents)
    return dict(zip(state["ranks"], state["worker_pids"], strict=True))[rank]


def finish(cluster: Cluster) -> None:
    """The job runs to the end: every agent exits 0, every step's batch once, nothing left over."""
    (cluster.tmp / "hold").unlink(missing_ok=True)
    assert [a.proc.wait(timeout=WAIT) for a in cluster.agents] == [0] * len(cluster.agents), hang_lines(cluster)
    assert cluster.leftovers() == []
    check_exactly_once(cluster)
    assert (cluster.tmp / "ckpt" / "latest").read_text().strip() == f"step-{STEPS:08d}"


def test_a_worker_that_stops_making_progress_is_named_and_the_job_trains_on(cluster: Cluster) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    hang = ["--hang-at", str(HANG_AT), "--hang-rank", "1"]
    (cluster.tmp / "hold").write_text("0")  # hold before step 1 until both nodes are in
    cluster.start(argv(cluster, endpoint, 2, 1, 0, hang))
    cluster.wait_store(endpoint)
    cluster.start(argv(cluster, endpoint, 2, 1, 1, hang))
    started = lambda: any(re.search(r"world=2 .*resumed at step 0", a.output()) for a in cluster.agents)  # noqa: E731
    wait_for(started, WAIT, "the world of 2", cluster.agents)
    (cluster.tmp / "hold").write_text(str(STEPS))  # run (the hold only ends the job's start-up pause)
    marker = cluster.tmp / "record.hang"
    wait_for(marker.exists, WAIT, "rank 1 hanging", cluster.agents)
    t_hang = float(marker.read_text())
    first = wait_for(lambda: retrained(cluster, t_hang), WAIT, "the job training again", cluster.agents)
    assert first["resumed"] == RESUME
    lines = hang_lines(cluster)
    assert len(lines) == 1, lines  # the waiting rank's agent left it to the hung rank's
    index, line = lines[0]
    assert re.search(rf"hang: rank 1 .* after step {HANG_AT - 1} .*outside the engine's collectives", line), line
    assert "Python stacks: in its log" in line
    assert re.search(r"File \".*train_driver.py\", line \d+ in maybe_hang", cluster.agents[index].output())
    assert cluster.agents[index].state()["restart_count"] == 1  # a real failure: the restart is spent
    finish(cluster)
    trained_again(cluster, first, t_hang, "hang")


def test_a_stopped_worker_is_named_and_the_job_trains_on(cluster: Cluster) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    (cluster.tmp / "hold").write_text(str(HANG_AT - 1))  # the job holds after step 4 (its loop heartbeats)
    cluster.start(argv(cluster, endpoint, 1, 2, 0, []))
    held = lambda: {r["rank"] for r in records(cluster) if r["step"] == HANG_AT - 1} == {0, 1}  # noqa: E731
    wait_for(held, WAIT, f"step {HANG_AT - 1}", cluster.agents)
    pid = worker_pid(cluster, 0, 1)
    t_stop = time.time()
    os.kill(pid, signal.SIGSTOP)  # the worker only: its agent and its peer run on
    (cluster.tmp / "hold").unlink()
    first = wait_for(lambda: retrained(cluster, t_stop), WAIT, "the job training again", cluster.agents)
    assert first["resumed"] == RESUME
    lines = hang_lines(cluster)
    assert len(lines) == 1, lines
    assert re.search(rf"hang: rank 1 \(local rank 1, pid {pid}\) .* after step {HANG_AT - 1} .*stopped", lines[0][1])
    assert "Python stacks: none: a stopped process cannot dump them" in lines[0][1]
    assert cluster.agents[0].state()["restart_count"] == 1
    finish(cluster)
    trained_again(cluster, first, t_stop, "SIGSTOP")
