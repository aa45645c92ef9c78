"""Live recovery beside the restart path, in one run: time from a membership change to the first step at the new
world, committed steps lost, and what the in-memory copies cost.

    .venv/bin/python bench/live_recovery_bench.py                                  # smoke: 2 reps, tiny GPT
    .venv/bin/python bench/live_recovery_bench.py --reps 10 --seed 1               # >= 10 events per kind and path
    .venv/bin/python bench/live_recovery_bench.py --size bench --reps 3 --copy-rounds 3
    .venv/bin/python bench/live_recovery_bench.py --size bench --seq-len 32 --global-batch 4 --micro-batch 2 --reps 10

**The jobs.** ``examples/train_gpt.py`` (ZeRO-2, gloo, ``--size tiny``, ``bench`` or ``large`` — the example's
byte-level vocabulary makes the bench GPT 25.5M parameters there (29.5M in copies_bench's 4096 vocabulary), the large
one 85.5M; through its test driver
``tests/integration/elastic/train_driver.py``, which records every step) under two ``elasticzero-run --nnodes 1:2
--rdzv-backend c10d`` agents on this machine, each a "node" with one worker, the agents' default rendezvous settings.
Two paths: ``restart`` (today's agents: a membership change restarts the workers from the newest checkpoint, every
``--save-every`` steps, ``--async-save``) and ``live`` (``--live-recovery``: the running workers take the new round in
memory; the same ``--save-every`` checkpoints, synchronous — live mode refuses ``--async-save``, which it used to
ignore — read only by a whole-job restart). One job per block and path; the blocks
alternate the paths (restart, live, live, restart, ...) so a drift of the shared machine's load hits both alike.

**The events**, ``--events`` (each ``--reps`` times per path, over all blocks):

- ``kill`` — a random 1..K steps after the world of 2 formed (K = ``--save-every``), plus a random fraction of a
  step, the non-store node's agent and its worker are SIGKILLed together (a machine dying). ``--victim-rank`` says
  whether that node's worker is rank 1 (default) or rank 0 of the world of 2 (``alternate``: 1, 0, 1, ... within
  each kind of loss, so that kills and freezes lose each rank alike): the c10d rendezvous orders the nodes by
  address, then pid, so every agent gets a loopback ``--local-addr`` that puts it there (with pids alone a pid
  wrap-around swaps the ranks at random);
- ``freeze`` — the same node's agent and worker SIGSTOPped together (a hung machine: nothing exits, no socket closes).
  Once the survivor has trained at world 1 the frozen processes are SIGKILLed (the bench's cleanup, after the
  measurement; they are not resumed);
- ``join`` — after each loss, a random 3..K+2 steps into the world-1 run, a new agent starts and the job grows back
  to world 2 (with ``join`` alone the losses are kills, not reported).

**Per event**, from the job's per-step record (one JSON line per rank per completed — live: committed — step, with the
worker's process start time) and the bench's own instants:

- event -> first step at the new world: from the signal (or the new agent's start) until every rank of the new world
  has completed its first step there. Split, restart path: detect + rendezvous + restart (-> the new workers'
  processes exist), worker start (interpreter, torch, process group, model), checkpoint load, first step. Live path:
  detect + rendezvous + hand-off (-> the new round's file, written by the agents: its mtime, polled), reshard + first
  step (for a join this includes the fresh worker's start: ``new worker created`` says when its process began);
- committed steps lost: steps completed at the old world before the event and completed again at the new world
  (restart: the steps since the checkpoint it resumed from; live: steps recorded twice, which must be 0). The whole
  job's record is also checked for steps recorded more than once;
- whether the survivor kept its process (a rank of the new world whose process started before the event);
- the step time at the new world (median interval of its consecutive steps): at world 2 the live path's steps carry
  the copies, the restart path's do not.

- a join's pause: the survivors' longest interval between two consecutive steps they committed, from their last step
  before the join to the first step of the new world, in their median step time before the join (live: they train
  on at the old world until the joiner's worker is ready); and the switch's own step: each survivor's last step at
  the old world to its first at the new one. The two differ on this one machine: the joiner's cold start (its
  interpreter, ``import torch``) takes cores from the survivors' steps before the switch.
- the entry's phases (the driver's ``entry``, :attr:`elasticzero.live.loop.RoundState.entry`): group, build, reshard,
  agree, copies — the survivors' slowest and a fresh process's (in its first round: a joiner).

Summary per path and event: median [min, max], side by side, and the restart / live ratio of the medians; then issue
31's goal for each kind against the live path's median: a kill <= 2 s to the first step at the new world, a freeze <=
the peer timeout + 1 s, a join's pause <= 1.5 x the step.

**The copies' cost** (``--copy-sizes``, default ``bench``: the 29.5M-parameter GPT of the issue's goal):
``bench/copies_bench.py`` run from here on 2 ranks, ZeRO-2 — step time with and without the ``BuddyCopies`` in the same
processes, bytes the copies send per step per rank beside the training collectives', the copies' host memory per rank
— and the 5 % verdict. Not a test: nothing asserts; the figures depend on the machine's load, printed with them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

# the restart path's bench (its wait and store probe; it puts tests/ on sys.path: the one free-port rule)
from elastic_recovery_bench import _connects, wait_until
from elasticzero.agent.proctree import descendants, kill_now, processes_with_env, signal_all
from ez_ports import free_port

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
RUN = Path(sys.executable).with_name("elasticzero-run")
DRIVER = REPO / "tests" / "integration" / "elastic" / "train_driver.py"
PATHS = ("restart", "live")
EVENTS = ("kill", "freeze", "join")
SIZES = ("tiny", "bench", "large")
#: the store's agent and the victims' local addresses (all loopback): the c10d rendezvous sorts the nodes by address
#: (then pid: with pids alone a pid wrap-around would swap the ranks at random), so the victim's worker is rank 0 or 1
STORE_ADDR, VICTIM_ADDR = "127.0.0.2", {0: "127.0.0.1", 1: "127.0.0.3"}
VICTIMS = ("0", "1", "alternate")
TIMEOUT = 240.0  # seconds to wait for any one event (a hang, not a measurement)
NEW_WORLD = {"kill": 1, "freeze": 1, "join": 2}
TITLES = {
    "kill": "node loss (SIGKILL agent + worker)",
    "freeze": "node freeze (SIGSTOP agent + worker; SIGKILLed after the survivor trains again)",
    "join": "node join (new agent)",
}
#: issue 31's goals (live, medians): a crash -> the first step at the new world; a freeze: the peer timeout + this; a
#: join: the survivors' longest step interval during it, in their step times before it; the copies' step-time overhead
CRASH_GOAL_S, FREEZE_SLACK_S, JOIN_PAUSE_X, GOAL_PCT = 2.0, 1.0, 1.5, 5.0


class Record:
    """The job's ``--record-samples`` file, read incrementally (one JSON line per rank per completed step)."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self._tail = path, 0, b""
        self.lines: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = self._tail + fh.read()
                self._offset = fh.tell()
            *whole, self._tail = data.split(b"\n")
            self.lines += [json.loads(line) for line in whole]
        return self.lines


class RoundWatch:
    """The live agents' round files, polled: every new round seen as ``(number, world_size, mtime)`` (the mtime is
    the agent's write: the file is renamed into place whole)."""

    def __init__(self, job_id: str) -> None:
        self.pattern = f"elasticzero-round-{job_id}-*/round.json"
        self.root = Path(os.environ.get("TMPDIR") or "/tmp")  # the agents' rule (agent/handoff.py live_plan)
        self.seen: dict[tuple[str, int], tuple[int, int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RoundWatch:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[int, int, float]]:
        self._stop.set()
        self._thread.join()
        return sorted(self.seen.values(), key=lambda r: r[2])

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for f in self.root.glob(self.pattern):
                self._note(f)

    def _note(self, f: Path) -> None:
        try:
            mtime, r = f.stat().st_mtime, json.loads(f.read_text())
        except (OSError, ValueError):  # replaced or removed meanwhile: the next poll sees the new one
            return
        self.seen.setdefault((str(f.parent), r["round"]), (r["round"], r["world_size"], mtime))


@dataclass
class Job:
    """One elastic job of one path: agents in their own sessions, its record, the event instants."""

    tmp: Path
    path: str
    args: argparse.Namespace
    rng: random.Random
    job_id: str = field(default_factory=lambda: f"ezlive-{uuid.uuid4().hex[:8]}")
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    events: list[tuple[str, float]] = field(default_factory=list)
    victims: list[int] = field(default_factory=list)  #: per loss, the rank the lost node's worker had

    def __post_init__(self) -> None:
        self.record = Record(self.tmp / "record.jsonl")
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.rounds = RoundWatch(self.job_id)

    def argv(self, addr: str) -> list[str]:
        a = self.args
        agent = [str(RUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        agent += ["--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job_id, "--max-restarts", "1000"]
        agent += ["--local-addr", addr]  # the rendezvous orders the nodes by address, then pid: who is rank 0
        agent += ["--live-recovery"] if self.path == "live" else []
        agent += ["--rdzv-conf", a.rdzv_conf] if a.rdzv_conf else []
        job = [str(DRIVER), "--config", str(REPO / "examples" / "configs" / "gpt.yaml"), "--zero", "2"]
        job += ["--size", a.size, "--seq-len", str(a.seq_len), "--steps", "1000000", "--corpus-bytes", str(1 << 20)]
        job += ["--checkpoint-dir", str(self.tmp / "ckpt"), "--save-every", str(a.save_every)]
        job += [] if self.path == "live" else ["--async-save"]  # live mode refuses it (its saves are bounded, in line)
        job += ["--cache-dir", str(self.tmp / "corpus"), "--record-samples", str(self.record.path)]
        job += ["--global-batch-size", str(a.global_batch)] if a.global_batch else []
        job += ["--micro-batch-size", str(a.micro_batch)] if a.micro_batch else []
        return [*agent, *job]

    def start_agent(self) -> None:
        """The store's agent, or the next victim: its address puts its worker at the rank ``--victim-rank`` says."""
        addr = STORE_ADDR if not self.agents else VICTIM_ADDR[self.next_victim()]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTICZERO_JOB_ID": self.job_id}
        with (self.tmp / f"agent{len(self.agents)}.log").open("wb") as log:
            argv = self.argv(addr)
            self.agents.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True))

    def next_victim(self) -> int:
        """The rank of the node the next loss takes (see :func:`victim_rank`)."""
        return victim_rank(self.args.victim_rank, len(self.victims), len(self.args.losses))

    def start(self) -> None:
        """Two agents (the first hosts the c10d store); the first event waits for the world of 2 to train."""
        self.rounds.start()
        self.start_agent()
        host, port = self.endpoint.rsplit(":", 1)
        wait_until(lambda: _connects(host, int(port)), "the rendezvous store", self.args.timeout)
        self.start_agent()

    def first_step(self, world: int, after: float) -> int:
        """The first step every rank of ``world`` completed after ``after`` (waits for it)."""
        return wait_until(lambda: first_complete(self.record.poll(), world, after), f"world {world}", self.args.timeout)

    def reach(self, world: int, step: int, after: float) -> None:
        done = lambda: step in complete_steps(self.record.poll(), world, after)  # noqa: E731
        wait_until(done, f"step {step} at world {world}", self.args.timeout)

    def lose_node(self, kind: str, world2_since: float) -> float:
        """A random 1..K steps into the world of 2 (plus a fraction of a step), kill or freeze the second node."""
        first = self.first_step(2, world2_since)
        self.reach(2, first + self.rng.randint(0, self.args.save_every - 1), world2_since)
        time.sleep(self.rng.random() * (step_time(self.record.poll(), 2, world2_since) or 0.0))
        victim = self.agents[-1]
        tree = descendants([victim.pid])
        self.victims.append(self.next_victim())
        t = time.time()
        self.events.append((kind, t))
        if kind == "kill":
            kill_now(tree)
        else:
            signal_all(tree, signal.SIGSTOP)  # the survivor goes on alone; then the frozen node goes for good
            self.first_step(1, t)
            kill_now(tree)
        victim.wait(timeout=30)
        return t

    def join_node(self, world1_since: float) -> float:
        """A random 3..K+2 steps into the world-1 run, start a new agent."""
        first = self.first_step(1, world1_since)
        self.reach(1, first + self.rng.randint(2, self.args.save_every + 1), world1_since)
        t = time.time()
        self.events.append(("join", t))
        self.start_agent()
        return t

    def stop(self) -> list[tuple[int, int, float]]:
        procs = descendants(a.pid for a in self.agents) + processes_with_env("ELASTICZERO_JOB_ID", self.job_id)
        kill_now(procs)
        for a in self.agents:
            a.wait(timeout=30)
        rounds = self.rounds.stop()
        for d in self.rounds.root.glob(f"elasticzero-*-{self.job_id}-*"):  # a SIGKILLed agent cannot remove its round
            shutil.rmtree(d, ignore_errors=True)  # and progress folders ($TMPDIR/elasticzero-<what>-<job>-<agent pid>)
        return rounds


# ---------------------------------------------------------------- analysis (pure: record + rounds + instants -> rows)


def by_step(lines: list[dict[str, Any]], world: int, after: float, before: float = float("inf")) -> dict[int, list]:
    """The records at ``world`` completed in (after, before), per step."""
    steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in lines:
        if r["world"] == world and after < r["time"] < before:
            steps[r["step"]].append(r)
    return steps


def complete_steps(lines: list[dict[str, Any]], world: int, after: float, before: float = float("inf")) -> dict:
    """The steps every rank of ``world`` completed in (after, before), with their records."""
    return {s: rs for s, rs in by_step(lines, world, after, before).items() if len(rs) >= world}


def first_complete(lines: list[dict[str, Any]], world: int, after: float) -> int | None:
    done = complete_steps(lines, world, after)
    return min(done) if done else None


def step_time(lines: list[dict[str, Any]], world: int, after: float, before: float = float("inf")) -> float | None:
    """Median interval between consecutive completed steps at ``world`` in (after, before) (None: fewer than two)."""
    done = {s: max(r["time"] for r in rs) for s, rs in complete_steps(lines, world, after, before).items()}
    gaps = [done[s] - done[s - 1] for s in done if s - 1 in done]
    return statistics.median(gaps) if gaps else None


def analyse(
    path: str,
    lines: list[dict],
    rounds: list[tuple[int, int, float]],
    events: list[tuple[str, float]],
    victims: list[int],
):
    """One row per event: event -> first step at the new world and its parts, steps lost, process kept, step time.
    The records' ``started`` is on the ``time.time()`` clock (the driver's ``process_start``)."""
    rows, losses = [], iter(victims)
    for i, (kind, t) in enumerate(events):
        victim = next(losses) if kind != "join" else None
        t_prev = events[i - 1][1] if i else 0.0
        t_next = events[i + 1][1] if i + 1 < len(events) else float("inf")
        new_world = NEW_WORLD[kind]
        new = complete_steps(lines, new_world, t, t_next)
        if not new:
            continue
        old = by_step(lines, 3 - new_world, t_prev, t)
        first = new[min(new)]
        t_first = max(r["time"] for r in first)
        row = {"kind": kind, "victim": victim, "from_event": t_first - t, "lost": len(set(old) & set(new))}
        row["kept"] = any(r["started"] < t for r in first)
        row["step_s"] = step_time(lines, new_world, t, t_next)
        if kind == "join":
            row["pause_x"] = join_pause(lines, t, t_prev, t_first)
            row["switch_x"] = switch_pause(lines, t, t_prev, t_first)
        hand = [m for _, w, m in rounds if w == new_world and m > t]
        if path == "restart":
            row["parts"] = restart_parts(t, t_first, first)
        else:
            row["parts"] = live_parts(kind, t, t_first, first, min(hand)) if hand else {}
        rows.append(row)
    return rows


def join_pause(lines: list[dict[str, Any]], t: float, t_prev: float, t_first: float) -> float | None:
    """The survivors' longest interval between two consecutive steps they committed from their last step before the
    join (at ``t``) to the first step every rank of the new world completed, in their median step time before it."""
    before = step_time(lines, 1, t_prev, t)
    mine = sorted(r["time"] for r in lines if r["started"] < t and r["time"] <= t_first)
    spans = [b - a for a, b in itertools.pairwise(mine) if b > t]
    return max(spans) / before if spans and before else None


def switch_pause(lines: list[dict[str, Any]], t: float, t_prev: float, t_first: float) -> float | None:
    """The switch's own interval: each survivor's last step at the old world to its first at the new one (the
    longest over the survivors), in their median step time before the join. Apart from :func:`join_pause` because on
    one machine the joiner's cold start (its interpreter, ``import torch``) takes cores from the survivors' steps before
    the switch — a joiner on a node of its own does not."""
    before = step_time(lines, 1, t_prev, t)
    spans = []
    for pid in {r["pid"] for r in lines if r["started"] < t and t_prev <= r["time"] <= t_first}:
        mine = sorted((r["time"], r["world"]) for r in lines if r["pid"] == pid and t_prev <= r["time"] <= t_first)
        spans += [b - a for (a, _), (b, w) in itertools.pairwise(mine) if b > t and w == 2][:1]
    return max(spans) / before if spans and before else None


def restart_parts(t: float, t_first: float, first: list[dict[str, Any]]) -> dict[str, float]:
    started, loaded = max(r["started"] for r in first), max(r["loaded"] for r in first)
    load_s = max(r["load_s"] for r in first)
    return {
        "detect+rdzv+restart": started - t,
        "worker start": loaded - load_s - started,
        "ckpt load": load_s,
        "first step": t_first - loaded,
    }


def live_parts(kind: str, t: float, t_first: float, first: list[dict[str, Any]], t_round: float) -> dict[str, float]:
    """The live path's split; the survivors' records of their first step in the round say when they left the old
    group and when the new state was in place (the driver's ``entered``), splitting the reshard + first step."""
    parts = {"detect+rdzv+hand-off": t_round - t, "reshard+first step": t_first - t_round}
    entered = [r["entered"] for r in first if "entered" in r]
    if entered:
        left, ready = max(e["left"] for e in entered), max(e["ready"] for e in entered)
        parts |= {"  left old group": left - t_round, "  group+reshard": ready - left, "  first step": t_first - ready}
    parts |= entry_parts(first)
    if kind == "join":
        parts["  new worker created"] = max(r["started"] for r in first) - t_round
    return parts


#: the phases of a round's entry (the driver's ``entry``: :attr:`elasticzero.live.loop.RoundState.entry`)
PHASES = ("group", "build", "reshard", "agree", "copies")


def entry_parts(first: list[dict[str, Any]]) -> dict[str, float]:
    """group+reshard split into the entry's phases: the survivors' (their slowest), and a fresh process's (in its
    first round: a joiner) where one entered."""
    parts: dict[str, float] = {}
    for who, entries in (("", [r["entry"] for r in first if "entered" in r and "entry" in r]),
                         ("fresh ", [r["entry"] for r in first if "entered" not in r and "entry" in r])):  # fmt: skip
        for phase in PHASES if entries else ():
            parts[f"    {who}{phase}"] = max(e.get(phase, 0.0) for e in entries)
    return parts


def victim_rank(choice: str, loss: int, kinds: int) -> int:
    """The rank of the node lost at the job's ``loss``-th loss: ``--victim-rank`` 0, 1, or alternating from 1 within
    each kind of loss (the job loses ``kinds`` kinds in turn, so rep by rep: every kind loses each rank alike)."""
    return int(choice) if choice != "alternate" else 1 - (loss // kinds) % 2


def recorded_twice(lines: list[dict[str, Any]]) -> int:
    """Steps of the whole job recorded more than once (by more records than their world, or at two worlds)."""
    steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in lines:
        steps[r["step"]].append(r)
    return sum(len(rs) > rs[0]["world"] or len({r["world"] for r in rs}) > 1 for rs in steps.values())


# ---------------------------------------------------------------- report


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):5.2f}, {max(values):5.2f}]" if values else "-"


def report(rows: dict[str, list[dict[str, Any]]], kinds: list[str], peer_timeout_s: float) -> None:
    for kind in kinds:
        sel = {p: [r for r in rows[p] if r["kind"] == kind] for p in PATHS}
        print(f"\n{TITLES[kind]}; seconds unless stated; n = " + ", ".join(f"{len(sel[p])} ({p})" for p in PATHS))
        print(f"{'':32s}" + "".join(f" | {p + ' median [min, max]':>26s}" for p in PATHS) + " | restart/live")
        lines = [(f"{kind} -> first new-world step", lambda r: r["from_event"])]
        parts = list(dict.fromkeys(k for p in PATHS for r in sel[p] for k in r["parts"]))  # every row's, in order
        lines += [(f"  {k}", lambda r, k=k: r["parts"].get(k)) for k in parts]
        lines += [("committed steps lost", lambda r: r["lost"]), ("step time, new world", lambda r: r["step_s"])]
        if kind == "join":
            lines.append(("longest step / step (x)", _pause_x))
            lines.append(("switch step / step (x)", lambda r: r.get("switch_x")))
        for name, get in lines:
            values = {p: [v for r in sel[p] if (v := get(r)) is not None] for p in PATHS}
            print(f"{name:32s}" + "".join(f" | {_stats(values[p]):>26s}" for p in PATHS) + _ratio(values))
        kept = ", ".join(f"{p} {sum(r['kept'] for r in sel[p])} of {len(sel[p])}" for p in PATHS)
        print(f"{'survivor kept its process':32s} | {kept}")
        by_victim(sel)
        print(goal_line(kind, sel["live"], peer_timeout_s))


def peer_timeout_s(rdzv_conf: str) -> float:
    """The agents' peer timeout: their default, or what the keep-alive keys of ``--rdzv-conf`` make it."""
    from elasticzero.agent.liveness import peer_plan

    conf = dict(kv.split("=", 1) for kv in rdzv_conf.split(",") if "=" in kv)
    return float(peer_plan(None, conf, torch_defaults=False).timeout_s)


def _pause_x(row: dict[str, Any]) -> float | None:
    return row.get("pause_x")


def goal_line(kind: str, live: list[dict[str, Any]], peer_timeout_s: float) -> str:
    """Issue 31's goal for ``kind`` and whether the live path's median meets it."""
    if kind == "join":
        got, goal, what = [x for r in live if (x := r.get("pause_x")) is not None], JOIN_PAUSE_X, "x (longest step)"
    else:
        got = [r["from_event"] for r in live]
        goal, what = (CRASH_GOAL_S if kind == "kill" else peer_timeout_s + FREEZE_SLACK_S), " s (event -> first step)"
    if not got:
        return f"goal <= {goal:g}{what}: no live events"
    median = statistics.median(got)
    switch = [x for r in live if (x := r.get("switch_x")) is not None] if kind == "join" else []
    aside = f" (the switch's own step: {statistics.median(switch):.2f}x)" if switch else ""
    return f"goal <= {goal:g}{what}, live median {median:.2f}: {'met' if median <= goal else 'NOT met'}{aside}"


def by_victim(sel: dict[str, list[dict[str, Any]]]) -> None:
    """The losses split by the rank the lost node's worker had: event -> first step, process kept, steps lost."""
    for rank in sorted({r["victim"] for p in PATHS for r in sel[p] if r["victim"] is not None}):
        cells = []
        for p in PATHS:
            by = [r for r in sel[p] if r["victim"] == rank]
            kept, lost = sum(r["kept"] for r in by), _stats([r["lost"] for r in by])
            cells.append(f"{p}: {_stats([r['from_event'] for r in by])} s, kept {kept} of {len(by)}, lost {lost}")
        print(f"  the lost node was rank {rank}: " + "; ".join(cells))


def _ratio(values: dict[str, list[float]]) -> str:
    if not values["restart"] or not values["live"] or statistics.median(values["live"]) == 0:
        return " | -"
    return f" | {statistics.median(values['restart']) / statistics.median(values['live']):6.2f}x"


def copy_cost(size: str, rounds: int, tmp: Path) -> None:
    """``bench/copies_bench.py`` on 2 ranks, ZeRO-2, ``size``: step time with and without the copies, bytes, memory."""
    out = tmp / f"copies-{size}.json"
    argv = [sys.executable, str(HERE / "copies_bench.py"), "--size", size, "--stage", "2", "--rounds", str(rounds)]
    done = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"\ncopy cost, {size}: copies_bench failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
        return
    s = json.loads(out.read_text())["summary"]
    print(f"\ncopy cost, GPT {size} ({s['params'] / 1e6:.1f}M parameters), 2 ranks, ZeRO-2, {rounds} rounds "
          f"(copies_bench; load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"  step time without copies {s['step_ms_off']:.1f} ms, with {s['step_ms_on']:.1f} ms: "
          f"{s['overhead_pct']:+.1f} %; the copies' own hooks {s['copies_ms']:.1f} ms = "
          f"{s['copies_pct_of_off']:.1f} % of the step (exchange + gate {s['copies_exchange_gate_ms']:.1f} ms, "
          f"shadow steps {s['copies_shadow_step_ms']:.1f} ms)")  # fmt: skip
    print(f"  bytes sent per step per rank: copies {s['copies_sent_bytes_per_step'] / 2**20:.2f} MiB, training "
          f"collectives {s['train_sent_bytes_per_step'] / 2**20:.2f} MiB "
          f"({s['copies_sent_bytes_per_step'] / s['train_sent_bytes_per_step']:.2f}x)")  # fmt: skip
    print(f"  host memory per rank: copies {s['copies_host_bytes'] / 2**20:.1f} MiB beside the rank's model state "
          f"{s['model_state_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    ok = max(s["overhead_pct"], s["copies_pct_of_off"]) <= GOAL_PCT
    print(f"  goal <= {GOAL_PCT:g} % step time: {'met' if ok else 'NOT met'} (the larger of the two figures above)")


# ---------------------------------------------------------------- the run


def run_job(path: str, reps: int, rng: random.Random, args: argparse.Namespace) -> tuple[list[dict], int]:
    tmp = Path(tempfile.mkdtemp(prefix=f"ez-live-recovery-{path}-"))
    job = Job(tmp, path, args, rng)
    rounds: list[tuple[int, int, float]] = []
    try:
        job.start()
        t = 0.0
        for rep in range(reps):
            for kind in args.losses:
                t = job.join_node(job.lose_node(kind, t))
                print(f"  {path:7s} rep {rep + 1}: {kind}, joined; load average {os.getloadavg()[0]:.1f}", flush=True)
        job.reach(2, job.first_step(2, t) + 3, t)  # the last join's world of 2 trains a few steps (its step time)
    finally:
        rounds = job.stop()
    lines = job.record.poll()
    rows = analyse(path, lines, rounds, job.events, job.victims)
    print(f"  {path}: {len(rows)} events analysed; job directory {tmp}{'' if args.keep else ' (removed; --keep)'}")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return rows, recorded_twice(lines)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # bad input: one line, exit 2
        self.exit(2, f"live_recovery_bench: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="events of each kind per path, over all blocks (default 2)")
    p.add_argument("--events", default="kill,freeze,join", help=f"of {', '.join(EVENTS)} (default all)")
    p.add_argument("--paths", default="restart,live", help="the paths to run, of restart, live (default both)")
    p.add_argument("--size", default="tiny", help=f"the job's GPT, {', '.join(SIZES)} (default tiny)")
    p.add_argument("--seq-len", type=int, default=128, help="the job's sequence length (default 128)")
    p.add_argument("--save-every", type=int, default=5, help="checkpoint interval K, both paths (default 5)")
    p.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's, 16)")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward (default: the config's, 4)")
    p.add_argument("--blocks", type=int, default=2, help="jobs per path, alternating the paths (default 2)")
    p.add_argument("--victim-rank", default="1", help="the lost node's rank: 0, 1 (default) or alternate")
    p.add_argument("--seed", type=int, default=0, help="seeds the event points (default 0)")
    p.add_argument("--rdzv-conf", default="", help="the agents' --rdzv-conf (default: theirs)")
    p.add_argument("--copy-sizes", default="bench", help="GPT sizes for the copies' cost, or 'none' (default bench)")
    p.add_argument("--copy-rounds", type=int, default=2, help="copies_bench rounds (default 2)")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help=f"seconds to wait for any one event ({TIMEOUT:g})")
    p.add_argument("--keep", action="store_true", help="keep the job directories (logs, records, checkpoints)")
    args = p.parse_args(argv)
    args.events, args.paths = args.events.split(","), args.paths.split(",")
    args.copy_sizes = [] if args.copy_sizes == "none" else args.copy_sizes.split(",")
    for bad, fix in checks(args):
        if bad:
            p.error(fix)
    args.losses = [k for k in args.events if k != "join"] or ["kill"]
    args.paths = [p for p in PATHS if p in args.paths]
    return args


def checks(args: argparse.Namespace) -> list[tuple[bool, str]]:
    return [
        (not set(args.events) <= set(EVENTS), f"--events {','.join(args.events)}: choose from {', '.join(EVENTS)}"),
        (args.victim_rank not in VICTIMS, f"--victim-rank {args.victim_rank}: give 0, 1 or alternate"),
        (not set(args.paths) <= set(PATHS), f"--paths {','.join(args.paths)}: give restart, live or both"),
        (args.size not in SIZES, f"--size {args.size}: choose one of {', '.join(SIZES)}"),
        (
            min(args.global_batch, args.micro_batch) < 0
            or bool(args.global_batch) != bool(args.micro_batch)
            or (args.global_batch and args.global_batch % (2 * args.micro_batch) != 0),
            "--global-batch G --micro-batch M: give both, G a multiple of 2 x M (the job runs at worlds 1 and 2)",
        ),
        (not set(args.copy_sizes) <= {"tiny", "small", "bench"}, "--copy-sizes: tiny, small, bench or none"),
        (
            min(args.reps, args.save_every, args.blocks, args.copy_rounds, args.seq_len) < 1,
            "--reps, --save-every, --blocks, --copy-rounds, --seq-len: give >= 1",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERMed bench still stops its agents (finally)
    rng = random.Random(args.seed)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; cpus {os.cpu_count()}; load average {os.getloadavg()}")
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    twice: dict[str, int] = dict.fromkeys(PATHS, 0)
    for block in range(args.blocks):
        for path in args.paths if block % 2 == 0 else args.paths[::-1]:
            new, n = run_job(path, args.reps // args.blocks + (block < args.reps % args.blocks), rng, args)
            rows[path] += new
            twice[path] += n
    print(f"end {time.strftime('%H:%M:%S')}; load average {os.getloadavg()}")
    report(rows, [k for k in TITLES if k in args.events], peer_timeout_s(args.rdzv_conf))
    print("\nsteps recorded more than once over the whole jobs: " + ", ".join(f"{p} {twice[p]}" for p in PATHS))
    with tempfile.TemporaryDirectory(prefix="ez-live-copies-") as tmp:
        for size in args.copy_sizes:
            copy_cost(size, args.copy_rounds, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
