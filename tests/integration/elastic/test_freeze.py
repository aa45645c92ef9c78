"""A node freezes (SIGSTOP of its agent and workers: nothing exits, no socket closes), the survivor trains on, and the
frozen node, resumed, is fenced off the checkpoint directory and rejoins.

examples/train_gpt.py under two real ``elasticzero-run`` agents ("nodes" on loopback), with default rendezvous
settings (peer timeout 4 s). The frozen node's worker stops itself inside the checkpoint save of step 12
(``train_driver.py --freeze-file``: rank 0 right before its commit, another rank right before it writes its files),
then the test stops the node's agent. The survivor must train again at world 1 within 10 s of that, from step 6 (the
newest committed checkpoint). While the survivor is held at step 8 the frozen node is resumed: its stale worker must
leave the checkpoint directory exactly as it was (its own line says the write was refused) and its agent rejoins, so
the job ends at world 2 with every sample of the epoch trained once (committed progress) and no process of the job
left. c10d: the node not hosting the store freezes; etcd: the node whose worker is rank 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from ez_agentkit import ELASTICZERO_RUN, Cluster, wait_for
from test_elastic_e2e import CORPUS, DRIVER, GLOBAL, SEED, SEQ, STEPS, Case, committed_record, job, recorded

from elasticzero.agent.liveness import DEFAULT_PEER_TIMEOUT_S
from elasticzero.agent.options import RDZV_DEFAULTS
from elasticzero.agent.proctree import descendants
from elasticzero.data import ByteCorpus, epoch_order, stdlib_corpus
from ez_testing import agents_slack

pytestmark = [pytest.mark.multiproc, pytest.mark.clock, pytest.mark.timeout(180)]

FREEZE_AT, RESUME_AT, HOLD_AT = 12, 6, 8  # the save of step 12 freezes; step 6 is the newest committed before it
#: the issue's goal: the survivors train again within 10 s of the freeze, with default settings (printed)
RECOVERY_S = 10.0


def agent_argv(cluster: Cluster, rdzv: str, endpoint: str, i: int) -> list[str]:
    """An agent with elasticzero-run's default rendezvous settings (no --rdzv-conf, default monitor interval)."""
    backend = "c10d" if rdzv == "c10d" else "elasticzero"
    argv = [str(ELASTICZERO_RUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", backend]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-id", cluster.job_id, "--max-restarts", "0"]
    argv += ["--health-file", str(cluster.tmp / f"health{i}.json")]
    tmp = cluster.tmp
    hooks = ["--record-samples", str(tmp / "elastic.jsonl"), "--hold-file", str(tmp / "hold")]
    hooks += ["--freeze-file", str(tmp / "freeze")]
    return [*argv, str(DRIVER), *job(tmp, Case(zero=2, rdzv=rdzv, kill_at=FREEZE_AT, victim=0), "elastic"), *hooks]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time (what a write would change)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def node_procs(cluster: Cluster, i: int) -> list[psutil.Process]:
    """Agent ``i`` first, then every process below it (its workers)."""
    pid = cluster.agents[i].proc.pid
    return [psutil.Process(pid), *(p for p in descendants([pid]) if p.pid != pid)]


def started_at(cluster: Cluster, world: int, step: int) -> None:
    pattern = re.compile(rf"world={world} .*resumed at step {step}\b")
    agents = cluster.agents
    wait_for(lambda: any(pattern.search(a.output()) for a in agents), 120, f"world={world} at {step}", agents)


def test_frozen_node_survived_fenced_and_rejoins(endpoint: tuple[str, str], cluster: Cluster) -> None:
    rdzv, ep = endpoint
    ckpt, rec, hold, freeze = (cluster.tmp / n for n in ("elastic-ckpt", "elastic.jsonl", "hold", "freeze"))
    hold.write_text("0")  # both nodes in before step 1
    cluster.start(agent_argv(cluster, rdzv, ep, 0))
    if rdzv == "c10d":
        cluster.wait_store(ep)  # agent 0 hosts the store: the other one freezes
    cluster.start(agent_argv(cluster, rdzv, ep, 1))
    started_at(cluster, world=2, step=0)
    victim = 1 if rdzv == "c10d" else next(i for i in (0, 1) if cluster.agents[i].state()["ranks"] == [0])
    rank = cluster.agents[victim].state()["ranks"][0]
    survivor = 1 - victim
    freeze.write_text(f"{FREEZE_AT} {rank}")
    hold.write_text(str(FREEZE_AT))

    # the victim's worker stops itself inside the save of step 12; then its agent and the rest of the node
    frozen = lambda: [p for p in node_procs(cluster, victim) if _stopped(p)]  # noqa: E731
    worker = wait_for(frozen, 120, f"rank {rank} frozen in the save of step {FREEZE_AT}", cluster.agents)[0]
    hold.write_text(str(HOLD_AT))  # the survivor will hold before step 9 (no checkpoint write meanwhile)
    t_freeze = time.time()
    for p in node_procs(cluster, victim):
        p.send_signal(signal.SIGSTOP)

    started_at(cluster, world=1, step=RESUME_AT)
    wait_for(lambda: recorded(rec, RESUME_AT + 1, 1), 60, "the first step at world 1", cluster.agents)
    first = min((r for r in _records(rec) if r["world"] == 1), key=lambda r: r["time"])
    reformed, recovery = first["started"] - t_freeze, first["loaded"] - t_freeze
    print(f"{rdzv}: world 1's workers started {reformed:.2f} s after the freeze (the agents' part)")
    print(f"{rdzv}: trains again at world 1 {recovery:.2f} s after the freeze (resumed from step {RESUME_AT}; "
          f"first step done after {first['time'] - t_freeze:.2f} s)")  # fmt: skip
    wait_for(lambda: recorded(rec, HOLD_AT, 1), 60, f"step {HOLD_AT} at world 1", cluster.agents)

    # the frozen node resumes: its stale worker writes nothing, its agent rejoins
    # the worst order for fencing: the stale worker runs on into its write or commit before its agent wakes up
    before, (agent, *workers) = tree(ckpt), node_procs(cluster, victim)
    for p in workers:
        p.send_signal(signal.SIGCONT)
    refused = f"of step {FREEZE_AT} refused: the checkpoint directory belongs to a newer world"
    wait_for(lambda: refused in cluster.agents[victim].output(), 30, "the stale worker's refused write", cluster.agents)
    agent.send_signal(signal.SIGCONT)
    wait_for(lambda: not worker.is_running() or _zombie(worker), 30, "the stale worker's end", cluster.agents)
    assert tree(ckpt) == before
    started_at(cluster, world=2, step=RESUME_AT)
    hold.unlink()
    assert [a.proc.wait(timeout=120) for a in cluster.agents] == [0, 0], [a.output()[-2000:] for a in cluster.agents]
    assert cluster.leftovers() == []
    check_record(rec)
    # the agents' part: silent for the peer timeout (+ a monitor tick), the survivor stops its workers, and its round
    # closes after the last call; the slack is for the agents' own work, in proportion to this run's worker start-up
    startup = max(r["loaded"] - r["started"] for r in _records(rec) if r["world"] == 2 and r["resumed"] == 0)
    agents = DEFAULT_PEER_TIMEOUT_S + int(RDZV_DEFAULTS["last_call_timeout"]) + agents_slack(startup)
    assert reformed < agents, (reformed, agents)
    # training resumed at world 1 from the newest checkpoint: the agents' part plus one worker start-up. The start-up
    # (interpreter, torch, model, checkpoint load) is this machine's, so its reference is measured in this run: the
    # world-2 workers' own start -> resumed time; x1.5 for the noise of one process start against another. The issue's
    # 10 s (RECOVERY_S) is what that sum comes to on a quiet 2-core machine (8.6-9.5 s here); printed, not asserted
    bound = agents + 1.5 * startup
    print(
        f"{rdzv}: recovery {recovery:.2f} s; bound {bound:.2f} s (start-up {startup:.2f} s); "
        f"the issue's {RECOVERY_S:.0f} s {'met' if recovery < RECOVERY_S else 'MISSED'}"
    )
    assert recovery < bound, cluster.agents[survivor].output()[-3000:]


def check_record(path: Path) -> None:
    """Committed progress (the last attempt of each step) trains every sample of the epoch once, in its order."""
    n = len(ByteCorpus(stdlib_corpus(path.parent / "corpus", "train", max_bytes=CORPUS), SEQ))
    order = epoch_order(n, SEED, 0).tolist()
    last, _ = committed_record(path)
    assert sorted(last) == list(range(1, STEPS + 1))
    for step, recs in last.items():
        assert sorted(r["rank"] for r in recs) == list(range(recs[0]["world"])), step
        assert Counter(i for r in recs for _, i in r["samples"]) == Counter(order[(step - 1) * GLOBAL : step * GLOBAL])
    assert {last[s][0]["world"] for s in (RESUME_AT + 1, STEPS)} == {2}  # redone at world 2 after the rejoin


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _stopped(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
