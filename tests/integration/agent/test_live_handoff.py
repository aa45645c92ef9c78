"""Live recovery, the agent's side: real ``elasticzero-run --live-recovery`` agents ("nodes" on loopback) hand their
running workers each new round instead of restarting them.

The workers are ``ez_round_worker.py`` (no torch: each logs its pid and every round its node's round file shows).
One job goes through the three membership changes of issue 21 — a node SIGKILLed (agent and workers), a node
joining, a node SIGSTOPped and later resumed — and after each: the survivors' worker pids are those they started
with, each of them sees the new round within the agents' part of the change (the peer timeout, the rendezvous' last
call, a few monitor ticks), and the round files of all nodes agree (one world, one store, one prefix, the ranks
0..M-1 once each, numbers increasing). A joiner's workers start with the round the survivors are handed; the resumed
node (dropped while frozen) stops its stale workers and joins again as a new node, whose fresh workers get the round.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from ez_agentkit import WORKER, Agent, Cluster, wait_for

from elasticzero.agent.proctree import descendants

pytestmark = [pytest.mark.multiproc, pytest.mark.clock, pytest.mark.timeout(150)]

ROUND_WORKER = Path(__file__).with_name("ez_round_worker.py")
#: FAST_RDZV's peer timeout (keep_alive_interval * keep_alive_max_attempt) and last call, in seconds
PEER_TIMEOUT_S, LAST_CALL_S = 4.0, 1.0
#: the agents' own part of a change beyond the timeout and the last call: the peer read and the monitor tick that
#: notice it (0.2 s each), the rendezvous' store round trips, the round-number agreement and the workers' 20 ms poll —
#: well under a second on a quiet machine; 3 s leaves room for a loaded 2-core one. A restart would not show here at
#: all: the pids are checked separately.
SLACK_S = 3.0
HANDOFF_S = PEER_TIMEOUT_S + LAST_CALL_S + SLACK_S


def start_node(cluster: Cluster, backend: str, endpoint: str, nproc: int) -> Agent:
    i = len(cluster.agents)
    health = cluster.tmp / f"health{i}.json"
    argv = cluster.argv(endpoint, "2:3", nproc=nproc, backend=backend, extra=["--live-recovery"], health=health)
    argv[argv.index(str(WORKER))] = str(ROUND_WORKER)
    return cluster.start(argv)


def records(cluster: Cluster) -> list[dict[str, Any]]:
    out = []
    for path in sorted(cluster.out.glob("rounds.*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return out


def pids_of(agent: Agent) -> list[int]:
    state = agent.state()
    return list(state["worker_pids"]) if state and state.get("state") == "running" else []


def latest(cluster: Cluster, pid: int) -> dict[str, Any] | None:
    seen = [r for r in records(cluster) if r["pid"] == pid and "round" in r]
    return seen[-1] if seen else None


def round_of(cluster: Cluster, agents: list[Agent], world: int, after: int) -> tuple[int] | None:
    """``(number,)``: the round above ``after`` at ``world`` that every running worker of ``agents`` now sees.

    Every agent must have running workers: one between two rounds (a dropped node restarting its workers: its health
    file says ``stopped``) has not seen the round yet, it is not absent."""
    running = [pids_of(a) for a in agents]
    pids = [pid for pids in running for pid in pids]
    seen = [latest(cluster, pid) for pid in pids]
    views = {(s["round"]["round"], s["round"]["world_size"]) for s in seen if s is not None}
    if not all(running) or None in seen or len(views) != 1:
        return None
    number, size = views.pop()
    return (number,) if size == world and number > after else None


def wait_round(cluster: Cluster, agents: list[Agent], world: int, after: int, timeout: float) -> int:
    what = f"a round above {after} at world {world}"
    return int(wait_for(lambda: round_of(cluster, agents, world, after), timeout, what, cluster.agents)[0])


def check_agreement(cluster: Cluster, number: int, agents: list[Agent]) -> None:
    """Round ``number`` as every node's workers saw it: one world, store and prefix; ranks 0..M-1 once each."""
    views = {r["agent"]: r["round"] for r in records(cluster) if r.get("round", {}).get("round") == number}
    assert set(views) == {a.proc.pid for a in agents}, f"round {number} seen by {sorted(views)}"
    shared = {(v["world_size"], json.dumps(v["store"], sort_keys=True), v["prefix"]) for v in views.values()}
    assert len(shared) == 1, f"round {number}: the nodes disagree: {views}"
    ranks = sorted(n for v in views.values() for n in v["ranks"].values())
    assert ranks == list(range(next(iter(shared))[0])), f"round {number}: ranks {ranks}"


def signal_node(agent: Agent, sig: signal.Signals) -> float:
    procs = [psutil.Process(agent.proc.pid), *descendants([agent.proc.pid])]
    for p in procs:
        p.send_signal(sig)
    return time.time()


def first_seen(cluster: Cluster, pid: int, number: int) -> float:
    return min(r["seen"] for r in records(cluster) if r["pid"] == pid and r.get("round", {}).get("round") == number)


def said(agent: Agent, line: str) -> bool:
    return line in agent.output()


def assert_handed_off(
    cluster: Cluster, survivors: list[Agent], before: dict[int, list[int]], number: int, t0: float, within: float
) -> None:
    """The survivors kept their workers, each saw round ``number`` within ``within`` s of ``t0``, and each agent said
    so in one line and refreshed its health file (same pids, the round's ranks)."""
    line = f"handing the workers round {number} at world"
    for a in survivors:
        assert pids_of(a) == before[a.proc.pid], "a survivor's workers were restarted"
        # the agent writes the round (its workers see it: what wait_round waited for), refreshes its health file,
        # then prints the line: waited for, it is the last of the three
        wait_for(functools.partial(said, a, line), 10, f"the line {line!r}", survivors)
        view = latest(cluster, before[a.proc.pid][0])
        assert view is not None and sorted(view["round"]["ranks"].values()) == sorted(a.state()["ranks"])
        for pid in before[a.proc.pid]:
            late = first_seen(cluster, pid, number) - t0
            print(f"round {number}: worker {pid} saw it {late:.2f} s after the event (bound {within} s)")
            assert late < within, f"worker {pid} saw round {number} {late:.1f} s after the event (bound {within} s)"


def test_survivors_keep_their_workers_through_kill_join_and_freeze(endpoint: tuple[str, str], cluster: Cluster) -> None:
    rdzv, ep = endpoint
    backend = "c10d" if rdzv == "c10d" else "elasticzero"
    a0 = start_node(cluster, backend, ep, nproc=2)
    if backend == "c10d":
        cluster.wait_store(ep)  # node 0 hosts the store: it is never the one killed or frozen
    a1, a2 = start_node(cluster, backend, ep, nproc=1), start_node(cluster, backend, ep, nproc=1)
    first = wait_round(cluster, [a0, a1, a2], world=4, after=-1, timeout=60)
    check_agreement(cluster, first, [a0, a1, a2])

    # SIGKILL of node 2 (agent and workers): nodes 0 and 1 are handed world 3
    before = {a.proc.pid: pids_of(a) for a in (a0, a1)}
    t0 = signal_node(a2, signal.SIGKILL)
    killed = wait_round(cluster, [a0, a1], world=3, after=first, timeout=HANDOFF_S + 10)
    assert_handed_off(cluster, [a0, a1], before, killed, t0, HANDOFF_S)
    check_agreement(cluster, killed, [a0, a1])

    # a node joins: the survivors are handed world 4, the joiner's worker starts with that same round (every agent
    # writes its file before the joiner starts its worker: the survivors see it by the time that worker is up)
    a3 = start_node(cluster, backend, ep, nproc=1)
    joined = wait_round(cluster, [a0, a1, a3], world=4, after=killed, timeout=60)
    joiner = [r for r in records(cluster) if r["agent"] == a3.proc.pid]
    assert [r["round"]["round"] for r in joiner if "round" in r] == [joined]
    assert_handed_off(cluster, [a0, a1], before, joined, min(r["start"] for r in joiner if "start" in r), SLACK_S)
    check_agreement(cluster, joined, [a0, a1, a3])

    # SIGSTOP of node 1: nodes 0 and 3 are handed world 3; resumed, node 1 rejoins with fresh workers
    frozen_pids = pids_of(a1)
    before = {a.proc.pid: pids_of(a) for a in (a0, a3)}
    t0 = signal_node(a1, signal.SIGSTOP)
    frozen = wait_round(cluster, [a0, a3], world=3, after=joined, timeout=HANDOFF_S + 10)
    assert_handed_off(cluster, [a0, a3], before, frozen, t0, HANDOFF_S)
    check_agreement(cluster, frozen, [a0, a3])
    signal_node(a1, signal.SIGCONT)
    rejoined = wait_round(cluster, [a0, a1, a3], world=4, after=frozen, timeout=30)
    assert not set(pids_of(a1)) & set(frozen_pids), "the dropped node's stale workers were kept"
    assert "this node was dropped from the rendezvous" in a1.output()
    assert all(pids_of(a) == before[a.proc.pid] for a in (a0, a3))
    check_agreement(cluster, rejoined, [a0, a1, a3])

    for pid in {r["pid"] for r in records(cluster) if "round" in r}:  # every worker saw rising numbers
        numbers = [r["round"]["round"] for r in records(cluster) if r["pid"] == pid and "round" in r]
        assert numbers == sorted(set(numbers)), f"worker {pid} saw rounds {numbers}"
    assert not [r for r in records(cluster) if "error" in r]

    (cluster.out / "stop").touch()
    for a in (a0, a1, a3):
        assert a.proc.wait(timeout=30) == 0, a.output()[-3000:]
    assert not cluster.leftovers()
    assert [d.name for d in round_dirs(cluster)] == [f"elasticzero-round-{cluster.job_id}-{a2.proc.pid}"]  # SIGKILLed
    shutil.rmtree(round_dirs(cluster)[0])


def round_dirs(cluster: Cluster) -> list[Path]:
    """The job's round-file directories left on this machine (an agent that ends removes its own)."""
    return sorted(Path(os.environ.get("TMPDIR") or "/tmp").glob(f"elasticzero-round-{cluster.job_id}-*"))
