"""Time lost per node failure (and per node join) of the real elastic job, for two checkpoint intervals side by side.

    .venv/bin/python bench/elastic_recovery_bench.py                     # 6 kills + 6 joins per interval, K=5 and K=20
    .venv/bin/python bench/elastic_recovery_bench.py --reps 10 --save-every 5,20,50 --seed 1
    .venv/bin/python bench/elastic_recovery_bench.py --events kill,freeze,freeze-worker --reps 10 --save-every 5
    .venv/bin/python bench/elastic_recovery_bench.py --events kill,freeze,partition --reps 10 --save-every 5

The job is ``examples/train_gpt.py`` (ZeRO-2, gloo, tiny GPT, ``--async-save --save-every K``), run through its test
driver ``tests/integration/elastic/train_driver.py`` (the example's trainer plus ``--record-samples``), under two
``elasticzero-run --nnodes 1:2 --rdzv-backend c10d`` agents on this machine, each a "node" with one worker (the
rendezvous settings are elasticzero-run's defaults). One job per block and interval; the blocks alternate the
intervals (K=5, K=20, K=5, K=20: side by side under the same load). Each repetition in a job:

1. **node loss** — at a random point between checkpoints (a random step 1..K after the checkpoint the world-2 run
   resumed from, plus a random fraction of a step) the non-store agent and its worker are SIGKILLed together (the
   agent's process tree: a machine dying). The survivor's agent restarts its worker at world 1 from the newest
   committed checkpoint.
2. **node join** — a random 3..K+2 steps into the world-1 run a new agent starts; the survivor's agent restarts its
   worker for the joiner and the job goes on at world 2 from the newest committed checkpoint.

``--events`` picks the failures, taken in turn (each ``--reps`` times per interval):

- ``kill`` — the node loss above (SIGKILL of the non-store agent and its worker), then a join;
- ``freeze`` — the same node's agent and worker SIGSTOPped together (a hung machine: nothing exits, no socket
  closes); the survivor must notice through its peer liveness check and go on at world 1. Once it trains again the
  frozen processes are SIGKILLed (the bench's cleanup, not part of the measurement) and a new agent joins. Without
  peer liveness in the agent the survivor waits for the collective timeout: the event times out (``--timeout``);
- ``freeze-worker`` — only that node's worker is SIGSTOPped (its agent lives): its agent's hang watch kills it after
  ``--hang-timeout`` and both nodes restart at world 2 from the newest checkpoint (no join needed);
- ``partition`` — every packet between the two nodes is dropped (``tc`` filters in both namespace hosts,
  ``ez_testing.partition``: healed in a ``finally``, also on Ctrl-C). The survivor (the store's node) must notice
  through its peer liveness check and go on at world 1; the cut-off node cannot reach the store: its agent says so in
  one line, stops its worker and exits. The bench waits for both, checks that no process of the job (by job id) is
  left on the cut-off host (any found is reported and killed), heals the cut and a new agent joins on that host.

With ``partition`` among the events the whole job (every event of the run) runs on the real-part test bed
(``/run/elasticzero-testbed/testbed.json``): the store's agent in one namespace host, the other node and the joiners
in another, each entered as its sshd is (its network and UTS namespaces: its own address and host name), the
rendezvous store on the first host's address. Without the test bed the bench says so in one line and exits 2.

Everything is read afterwards from the job's own per-step record (``--record-samples``: step, world, attempt,
resumed step, the worker's process start time, its checkpoint-load seconds, the step's completion time) and the
bench's kill/join wall-clock instants. For a loss, with ``last`` the last step completed before the kill, ``R`` the
checkpoint the new world resumed from and ``s1`` its steady step time (median step interval, first step excluded):

- steps redone = ``last - R``;
- time lost = from ``last``'s completion until the job has completed ``last`` again at the new world size
  (``t(first new step) + (redone - 1) * s1 - t(last)``), split into: in-flight (``last`` done -> kill: the partial
  step under way), detect + re-rendezvous + restart (kill -> new worker process created), worker start (interpreter,
  torch import, process group, model build), checkpoint load, first-step overhead (first step minus ``s1``: warm-up)
  and the redone steps (``redone * s1``). The parts sum to the total.

For a join: pause = last world-1 step -> first world-2 step (the survivor stops for the restart), join -> first
world-2 step (from starting the new agent), steps redone (``last world-1 step - R``) and time lost (the same
definition as above). Not a test: the figures depend on the machine's load, printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elasticzero.agent.proctree import descendants, kill_now, processes_with_env

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration" / "launch"))
# tests/ on sys.path: the test bed and its partition, the one free-port rule, a job's processes per namespace host
from launchkit import leftovers

import ez_testing
from ez_ports import free_port

REPO = Path(__file__).resolve().parents[1]
RUN = Path(sys.executable).with_name("elasticzero-run")
DRIVER = REPO / "tests" / "integration" / "elastic" / "train_driver.py"  # examples/train_gpt.py + the record
TIMEOUT = 240.0  # seconds to wait for any one event before giving up on the job (a hang, not a measurement)
CUTOFF_WAIT = 60.0  # seconds for a cut-off node's agent to exit and its processes to end before it is reported odd
EVENTS = ("kill", "freeze", "freeze-worker", "partition")
TITLES = {
    "kill": "node loss (SIGKILL agent + worker)",
    "freeze": "node freeze (SIGSTOP agent + worker)",
    "freeze-worker": "worker freeze (SIGSTOP of one worker, its agent alive)",
    "partition": "network partition (tc drop between the two namespace hosts)",
    "join": "node join (new agent)",
}


def wait_until(pred: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


class Records:
    """The job's ``--record-samples`` file, read incrementally: per attempt, per step, the ranks' records."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self._tail = path, 0, b""
        self.attempts: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))

    def poll(self) -> Records:
        if self.path.exists():
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = self._tail + fh.read()
                self._offset = fh.tell()
            *lines, self._tail = data.split(b"\n")
            for line in lines:
                r = json.loads(line)
                self.attempts[r["attempt"]][r["step"]].append(r)
        return self

    def done(self, attempt: int, step: int) -> bool:
        """Every rank of ``attempt`` recorded ``step``."""
        recs = self.attempts[attempt].get(step, [])
        return bool(recs) and len(recs) == recs[0]["world"]

    def newest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest attempt and one of its records (fields shared by its ranks)."""
        if not self.attempts:
            return None
        attempt = max(self.attempts)
        steps = self.attempts[attempt]
        return attempt, steps[min(steps)][0]


@dataclass(frozen=True)
class Hosts:
    """The job's two "nodes" on the test bed: ``store`` hosts the first agent (and the c10d store), ``other`` the second
    one and every joiner. An agent enters a host as its sshd did (network + UTS namespaces: what pdsh lands in)."""

    tb: ez_testing.Testbed
    store: int
    other: int

    def enter(self, host: int) -> list[str]:
        sshd = ez_testing.TESTBED_FILE.parent / f"sshd-{self.tb.hosts[host]}.pid"
        return ["nsenter", "--target", sshd.read_text().strip(), "--net", "--uts", "--"]


def testbed_hosts() -> Hosts | str:
    """The last two hosts of the running test bed, or the one line saying why there is none."""
    if not ez_testing.TESTBED_FILE.exists():
        return f"the partition event needs the real-part test bed ({ez_testing.TESTBED_FILE} missing: it is not up)"
    tb = ez_testing.testbed()
    missing = [t for t in ("tc", "nsenter", "ip") if not shutil.which(t)]
    missing += [str(p) for h in tb.hosts[-2:] if not (p := ez_testing.TESTBED_FILE.parent / f"sshd-{h}.pid").exists()]
    if len(tb.hosts) < 2 or missing:
        return f"the partition event needs two test-bed hosts with sshd (has {list(tb.hosts)}), missing: {missing}"
    return Hosts(tb, len(tb.hosts) - 2, len(tb.hosts) - 1)


@dataclass
class Cutoff:
    """What became of the cut-off node after one partition: when its agent exited, whether it said why, leftovers."""

    exit_s: float | None  #: its agent's exit, seconds after the cut (None: it had not exited after CUTOFF_WAIT)
    line: bool  #: its agent printed the store line
    left: list[int]  #: processes of the job on its host after the wait (its agent's when it had not exited; killed)
    cut_s: float  #: seconds the tc filters took to go in (the cut is complete that long after the event's instant)


@dataclass
class Job:
    """One elastic job: agents (own sessions), a checkpoint interval, its record and the kill/join instants."""

    tmp: Path
    save_every: int
    rng: random.Random
    script: Path = DRIVER
    hang_timeout: str | None = None  #: the agents' --hang-timeout (None: their default)
    timeout: float = TIMEOUT  #: seconds to wait for any one event
    job_id: str = field(default_factory=lambda: f"ezrec-{uuid.uuid4().hex[:8]}")
    hosts: Hosts | None = None  #: run on the test bed (the partition event), else every agent on this machine
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    events: list[tuple[str, float]] = field(default_factory=list)
    cutoffs: list[Cutoff] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.records = Records(self.tmp / "record.jsonl")
        host = self.hosts.tb.addrs[self.hosts.store] if self.hosts else "127.0.0.1"
        self.endpoint = f"{host}:{free_port()}"

    def argv(self) -> list[str]:
        agent = [str(RUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        agent += ["--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job_id, "--max-restarts", "1000"]
        # a partition's cut-off agent exits at once, as the bench's flow expects (a new agent joins after the heal);
        # an agent that stays and rejoins (the default since issue 33) is tests/integration/launch/test_partition.py's
        agent += ["--rejoin-timeout", "0"]
        agent += ["--hang-timeout", self.hang_timeout] if self.hang_timeout is not None else []
        job = [str(self.script), "--config", str(REPO / "examples" / "configs" / "gpt.yaml"), "--zero", "2"]
        job += ["--size", "tiny", "--seq-len", "128", "--steps", "1000000", "--corpus-bytes", str(1 << 20)]
        job += ["--checkpoint-dir", str(self.tmp / "ckpt"), "--save-every", str(self.save_every), "--async-save"]
        job += ["--cache-dir", str(self.tmp / "corpus")]
        return [*agent, *job, "--record-samples", str(self.records.path), "--hold-file", str(self.tmp / "hold")]

    def start_agent(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTICZERO_JOB_ID": self.job_id}
        with (self.tmp / f"agent{len(self.agents)}.log").open("wb") as log:
            argv = self.enter() + self.argv()
            self.agents.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True))

    def enter(self) -> list[str]:
        """The argv prefix that puts the next agent on its host (nothing without the test bed)."""
        if self.hosts is None:
            return []
        return self.hosts.enter(self.hosts.store if not self.agents else self.hosts.other)

    def logs_match(self, pattern: str) -> bool:
        rx = re.compile(pattern)
        return any(rx.search(p.read_text(errors="replace")) for p in self.tmp.glob("agent*.log"))

    def start(self) -> None:
        """Two agents (the first hosts the c10d store), held before step 1 until the world of 2 has formed."""
        (self.tmp / "hold").write_text("0")
        self.start_agent()
        host, port = self.endpoint.rsplit(":", 1)
        wait_until(lambda: _connects(host, int(port)), "the rendezvous store", self.timeout)
        self.start_agent()
        wait_until(lambda: self.logs_match(r"world=2 .*resumed at step 0\b"), "the first world of 2", self.timeout)
        (self.tmp / "hold").unlink()

    def current(self, world: int, after: float) -> tuple[int, dict[str, Any]]:
        """The running attempt at ``world`` whose worker started after ``after`` (waits for its first step)."""

        def found() -> tuple[int, dict[str, Any]] | None:
            new = self.records.poll().newest()
            ok = new and new[1]["world"] == world and new[1]["started"] > after and self.records.done(*_first(new))
            return new if ok else None

        return wait_until(found, f"a world of {world}", self.timeout)

    def reach(self, attempt: int, step: int) -> None:
        wait_until(lambda: self.records.poll().done(attempt, step), f"step {step}", self.timeout)

    def fail_node(self, kind: str, world2_after: float) -> None:
        """At a random point between checkpoints, fail the non-store node as ``kind`` says (module docstring): its
        agent's process tree SIGKILLed (``kill``) or SIGSTOPped (``freeze``), or its worker alone SIGSTOPped."""
        attempt, rec = self.current(2, world2_after)
        self.reach(attempt, rec["resumed"] + self.rng.randint(1, self.save_every))
        time.sleep(self.rng.random() * step_times(self.records.poll().attempts).get(2, 0.0))
        victim = self.agents[-1]
        if kind == "partition":
            self.partition(victim)
            return
        tree = psutil.Process(victim.pid).children() if kind == "freeze-worker" else descendants([victim.pid])
        t = time.time()
        self.events.append((kind, t))
        if kind == "kill":
            kill_now(tree)
            victim.wait(timeout=30)
            return
        for p in tree:
            p.send_signal(signal.SIGSTOP)
        if kind == "freeze":  # the survivor goes on alone; then the frozen node is removed for good
            self.current(1, t)
            kill_now(tree)
            victim.wait(timeout=30)

    def partition(self, victim: subprocess.Popen[bytes]) -> None:
        """Cut the two hosts apart until the survivor trains at world 1 and the cut-off node is gone; then heal."""
        assert self.hosts is not None
        exited: list[float] = []  # the instant its agent exits, taken by a thread blocked in wait()
        watch = threading.Thread(target=_note_exit, args=(victim, exited), daemon=True)
        watch.start()
        t = time.time()  # the event's instant: before the first filter (as a kill's is before its first signal)
        self.events.append(("partition", t))
        with ez_testing.partition(self.hosts.tb, self.hosts.store, self.hosts.other):
            cut_s = time.time() - t
            self.current(1, t)
            watch.join(CUTOFF_WAIT)
            self.cutoffs.append(self.cut_off_gone(victim, exited[0] - t if exited else None, cut_s))

    def cut_off_gone(self, victim: subprocess.Popen[bytes], exit_s: float | None, cut_s: float) -> Cutoff:
        """The cut-off host's part: its agent's line, and no process of the job left there (leftovers killed)."""
        assert self.hosts is not None
        host = self.hosts.tb.hosts[self.hosts.other]
        log = self.tmp / f"agent{self.agents.index(victim)}.log"
        line = "the c10d rendezvous store at" in log.read_text(errors="replace")
        left = leftovers(self.job_id, self.hosts.tb).get(host, [])  # by job id: its agent (not exited), workers
        said = "printed" if line else "did NOT print"
        gone = f"exited {exit_s:.2f} s after the cut" if exit_s is not None else f"NOT exited in {CUTOFF_WAIT:g} s"
        odd = "ODD " if exit_s is None or left or not line else ""
        print(f"  {odd}cut-off agent {gone}, {said} the store line; left on {host}: {left or 'nothing'}", flush=True)
        kill_now(_processes(left))
        victim.wait(timeout=30)
        return Cutoff(exit_s, line, left, cut_s)

    def join_node(self) -> float:
        """A random 3..K+2 steps into the world-1 run, start a new agent; returns the instant."""
        attempt, rec = self.current(1, self.events[-1][1])
        self.reach(attempt, rec["resumed"] + self.rng.randint(3, self.save_every + 2))
        t_join = time.time()
        self.events.append(("join", t_join))
        self.start_agent()
        return t_join

    def stop(self) -> None:
        procs = descendants(a.pid for a in self.agents) + processes_with_env("ELASTICZERO_JOB_ID", self.job_id)
        kill_now(procs)
        for a in self.agents:
            a.wait(timeout=30)


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def _note_exit(proc: subprocess.Popen[bytes], into: list[float]) -> None:
    proc.wait()
    into.append(time.time())


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _first(new: tuple[int, dict[str, Any]]) -> tuple[int, int]:
    return new[0], new[1]["resumed"] + 1


def step_times(attempts: dict[int, dict[int, list[dict[str, Any]]]]) -> dict[int, float]:
    """Per world size, the median interval between consecutive completed steps of one attempt, over all attempts
    (an attempt's first step, with its warm-up, has no interval: it is excluded)."""
    gaps: dict[int, list[float]] = defaultdict(list)
    for steps in attempts.values():
        done = {s: max(r["time"] for r in recs) for s, recs in steps.items()}
        gaps[_info(steps)["world"]] += [done[s] - done[s - 1] for s in done if s - 1 in done]
    return {world: statistics.median(g) for world, g in gaps.items() if g}


# ---------------------------------------------------------------- analysis (pure: records + instants -> figures)

KILL_PARTS = ("in-flight", "detect+rdzv+restart", "worker start", "ckpt load", "first-step extra", "redone steps")


def analyse(attempts: dict[int, dict[int, list[dict[str, Any]]]], events: list[tuple[str, float]]) -> list[dict]:
    """One row per kill/join: steps redone, time lost and its parts (seconds), from the record and the instants."""
    order, steady = sorted(attempts), step_times(attempts)
    rows = []
    for kind, t in events:
        before = [a for a in order if _info(attempts[a])["started"] < t]
        after = [a for a in order if _info(attempts[a])["started"] > t]
        if not before or not after:
            continue
        new = attempts[after[0]]
        rows.append(_row(kind, t, attempts[before[-1]], new, steady[_info(new)["world"]]))
    return rows


def _info(steps: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    return steps[min(steps)][0]


def _row(kind: str, t: float, old: dict[int, list[dict]], new: dict[int, list[dict]], step: float) -> dict[str, Any]:
    last = max(old)
    t_last = max(r["time"] for r in old[last])
    info = _info(new)
    resumed, load_s = info["resumed"], max(r["load_s"] for r in new[min(new)])
    started = max(r["started"] for r in new[min(new)])  # the world runs once its last worker has started
    t_ready = info["attempt"] / 1e9  # rank 0's clock after the checkpoint load (the attempt id)
    t_first = max(r["time"] for r in new[resumed + 1])
    redone = last - resumed
    parts = {
        "in-flight": t - t_last if kind != "join" else 0.0,
        "detect+rdzv+restart": started - (t if kind != "join" else t_last),
        "worker start": t_ready - started - load_s,
        "ckpt load": load_s,
        "first-step extra": t_first - t_ready - step,
        "redone steps": redone * step,
    }
    row = {"kind": kind, "redone": redone, "step_s": step, "world": info["world"], "parts": parts}
    row |= {"lost": sum(parts.values()), "pause": t_first - t_last, "from_event": t_first - t}
    return row


# ---------------------------------------------------------------- report


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} [{min(values):6.2f}, {max(values):6.2f}]"


def report(rows: dict[int, list[dict[str, Any]]]) -> None:
    ks = sorted(rows)
    head = "".join(f" | K={k:<3d} median [min, max]" for k in ks)
    kinds = [k for k in TITLES if any(r["kind"] == k for rr in rows.values() for r in rr)]
    for kind, title in ((k, TITLES[k]) for k in kinds):
        print(f"\n{title}; seconds unless stated; n = " + ", ".join(f"{_n(rows[k], kind)} (K={k})" for k in ks))
        print(f"{'':28s}{head}")
        lines = [("steps redone", lambda r: r["redone"]), ("time lost (s)", lambda r: r["lost"])]
        lines += [("  " + p, lambda r, p=p: r["parts"][p]) for p in KILL_PARTS]
        lines += [("pause: last step -> first", lambda r: r["pause"])]
        lines += [(f"{kind} -> first new step", lambda r: r["from_event"])]
        lines += [("step time, new world", lambda r: r["step_s"])]
        for name, get in lines:
            cells = "".join(f" | {_stats([get(r) for r in rows[k] if r['kind'] == kind]):>26s}" for k in ks)
            print(f"{name:28s}{cells}")
        fractions = []
        for k in ks:
            sel = [r for r in rows[k] if r["kind"] == kind]
            total = sum(r["lost"] for r in sel)
            split = ", ".join(f"{p} {sum(r['parts'][p] for r in sel) / total:.0%}" for p in KILL_PARTS)
            fractions.append(f"K={k}: {split}")
        print("split of the total (sums over repetitions):\n  " + "\n  ".join(fractions))


def _n(rows: list[dict[str, Any]], kind: str) -> int:
    return sum(r["kind"] == kind for r in rows)


def report_cutoffs(cutoffs: dict[int, list[Cutoff]]) -> None:
    """The cut-off nodes' side of the partitions: agent exit after the cut, its line, processes left behind."""
    for k, cuts in ((k, c) for k, c in sorted(cutoffs.items()) if c):
        exits = [c.exit_s for c in cuts if c.exit_s is not None]
        print(f"\ncut-off node, K={k}: n = {len(cuts)}; agent exited after the cut (s): "
              f"{_stats(exits) if exits else 'never'} ({len(exits)} of {len(cuts)} exited within {CUTOFF_WAIT:g} s); "
              f"store line printed {sum(c.line for c in cuts)} of {len(cuts)}; "
              f"events with processes of the job left on its host {sum(bool(c.left) for c in cuts)}; "
              f"the cut took {_stats([c.cut_s for c in cuts])} s to go in")  # fmt: skip


def run_job(
    k: int, reps: int, rng: random.Random, args: argparse.Namespace, hosts: Hosts | None
) -> tuple[list[dict[str, Any]], list[Cutoff]]:
    tmp = Path(tempfile.mkdtemp(prefix=f"ez-elastic-recovery-k{k}-"))
    job = Job(tmp, k, rng, args.script.resolve(), args.hang_timeout, args.timeout, hosts=hosts)
    try:
        job.start()
        t = 0.0
        for rep in range(reps):
            for kind in args.events:
                job.fail_node(kind, t)
                t = job.join_node() if kind != "freeze-worker" else job.events[-1][1]
                again = "re-joined" if kind != "freeze-worker" else "restarted"
                load = os.getloadavg()[0]
                print(f"  K={k:<3d} rep {rep + 1}: {kind}, {again}; load average {load:.1f}", flush=True)
        attempt, rec = job.current(2, t)  # the last join's world of 2 trains a few steps (its step time)
        job.reach(attempt, rec["resumed"] + 4)
    finally:
        job.stop()
    rows = analyse(job.records.poll().attempts, job.events)
    keep = args.keep
    print(f"  K={k}: {len(rows)} events analysed; job directory {tmp}{'' if keep else ' (kept only with --keep)'}")
    if not keep:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return rows, job.cutoffs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6, help="kills (and joins) per interval, over all blocks (default 6)")
    p.add_argument("--save-every", default="5,20", help="checkpoint intervals to compare (default 5,20)")
    p.add_argument("--blocks", type=int, default=2, help="jobs per interval, alternating the intervals (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill and join points (default 0)")
    p.add_argument("--keep", action="store_true", help="keep the job directories (logs, records, checkpoints)")
    p.add_argument("--script", type=Path, default=DRIVER, help=f"the job (default {DRIVER.relative_to(REPO)})")
    p.add_argument("--events", default="kill", help=f"failures to measure, in turn per repetition: {', '.join(EVENTS)}")
    p.add_argument("--hang-timeout", default="5", help="the agents' --hang-timeout (freeze-worker; default 5)")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help=f"seconds to wait for any one event ({TIMEOUT:g})")
    args = p.parse_args()
    args.events = args.events.split(",")
    if not set(args.events) <= set(EVENTS):
        p.error(f"--events {','.join(args.events)}: choose from {', '.join(EVENTS)}")

    hosts = testbed_hosts() if "partition" in args.events else None
    if isinstance(hosts, str):
        print(f"elastic_recovery_bench: {hosts}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERMed bench still stops its agents (finally)
    ks = [int(k) for k in args.save_every.split(",")]
    rng = random.Random(args.seed)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; cpus {os.cpu_count()}; load average {os.getloadavg()}")
    if hosts:
        names = hosts.tb.hosts
        print(f"on the test bed: store node {names[hosts.store]}, other node and joiners {names[hosts.other]}")
    rows: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
    cutoffs: dict[int, list[Cutoff]] = {k: [] for k in ks}
    for block in range(args.blocks):
        for k in ks:
            n = args.reps // args.blocks + (block < args.reps % args.blocks)
            new, cuts = run_job(k, n, rng, args, hosts)
            rows[k] += new
            cutoffs[k] += cuts
    print(f"end {time.strftime('%H:%M:%S')}; load average {os.getloadavg()}")
    report(rows)
    report_cutoffs(cutoffs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
