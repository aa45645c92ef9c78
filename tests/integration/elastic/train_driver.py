"""The example job (``examples/train_gpt.py``) with the hooks of the elastic tests and benchmarks around its training.

Run it as the example is run (under ``elasticzero-run``, with or without ``--live-recovery``, or directly: a world of
one), with the example's flags and:

- ``--record-samples FILE``: after every committed step each rank appends one JSON line ``{"step", "rank", "world",
  "pid", "attempt", "resumed", "started", "load_s", "loaded", "time", "samples": [[epoch, id], ...]}`` (``attempt``:
  one id per (re)start of a plain job, 0 under live recovery; ``loaded``: when the resume finished and training
  began, wall clock; live: ``entered`` on a survivor's first step in a round it entered) (docs/elastic-training.md,
  "The sample record");
- ``--hold-file FILE``: before step N+1 the job waits while FILE exists and holds a number <= N — plain: after step
  N's checkpoint, collectively (a lost peer fails the job); live: between the steps, before that checkpoint, each rank
  in a bounded wait (``Training.bounded``): a membership change during the hold is entered there once every member of
  the new round is ready (a joiner's worker started) — between two steps a round is switched to at once, a join too.
  A test holds the job at a known step this way; live, the round a rank starts in and each round it enters later are
  appended to ``<--record-samples>.rounds`` as it begins its first attempt or hold there (``{"pid", "rank", "world",
  "round", "step"}``; ``round`` null for the first), so a test can release the hold once the round it waits for is
  entered;
- ``--hang-at N --hang-rank R``: in an attempt that started from step 0, rank R stops making progress before step N
  (after the hold): it writes the wall-clock instant to ``<--record-samples>.hang`` and sleeps for good, while its
  peers go on into step N's collectives. The hang tests' hung worker;
- ``--cut-at N --cut-rank R``: live, once per process: before step N (after the hold) rank R shuts down its TCP
  connections to its peers' workers (every established socket but the round store's) and steps on: a dropped
  connection between live nodes, which fails the step's collective on both sides;
- ``--freeze-file FILE``: when FILE holds ``STEP RANK``, rank RANK stops itself (SIGSTOP) inside the checkpoint save of
  step STEP — rank 0 right before its commit, any other rank right before it writes its files — after renaming FILE
  to ``FILE.fired`` (once). A test then freezes the rest of that node and resumes it later (fencing).

:class:`Driven` is a set of :class:`elasticzero.live.Hooks` handed to the example's ``main``: the example's own
training runs, the hooks see its public points (the start, each attempt, each save's phases, each committed step).
Used by ``test_elastic_e2e.py``, ``test_live_e2e.py``, ``test_hang.py``, ``test_freeze.py`` and the recovery benches.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

import elasticzero
from elasticzero.live import Done, Hooks, Training

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))  # the example job and its gpt.py
import train_gpt


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="the example job with the tests' hooks", allow_abbrev=False)
    p.add_argument("--record-samples", type=Path, help="append each step's sample ids per rank to this JSONL file")
    p.add_argument("--hold-file", type=Path, help="before step N+1, wait while this file holds a number <= N")
    p.add_argument("--hang-at", type=int, help="rank --hang-rank sleeps for good before this step (first attempt)")
    p.add_argument("--hang-rank", type=int, default=0, help="the rank --hang-at hangs (default 0)")
    p.add_argument("--freeze-file", type=Path, help="'STEP RANK': that rank SIGSTOPs itself in that step's save")
    p.add_argument("--cut-at", type=int, help="live: rank --cut-rank drops its peer connections before this step")
    p.add_argument("--cut-rank", type=int, default=0, help="the rank --cut-at cuts (default 0)")
    return p


class Driven(Hooks):
    """The record, the hold, the hang and the freeze, through the training object's hooks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.started_at = args, process_start()  # this worker process's start (wall clock)
        self.attempt, self.loaded, self.reported = 0, 0.0, 0
        self.cut = False  # --cut-at done in this process
        self.rounds_seen = -1  # live rounds entered (training.events) written to <record>.rounds (-1: not the first)
        self.entry_reported: int | None = None  # the number of the live round whose entry split was recorded last

    def started(self, training: Training) -> None:
        self.loaded = time.time()
        if not training.live:
            self.attempt = attempt_id(training.device)
        self.hold_between_steps(training)

    def hold_between_steps(self, training: Training) -> None:
        """Live: the hold, between two steps — after a commit, before the next attempt's save of it: a round change
        during it lands between a save step's commit and its save (the join race of issue 21)."""
        path = self.args.hold_file
        while training.live and path is not None and training.step < training.total:
            # a new round: entered here. Checked before the hold is read, so also once after it ends: the agent
            # writes the round before its hand-off line and a test releases the hold after that line (checked only
            # while held, the step after the hold could run at the old world: 1 run of test_live_e2e in 10)
            training.bounded(lambda: time.sleep(0.05))
            self.note_rounds(training)
            if not held(path, training.step):
                break
            elasticzero.heartbeat()

    def before_save(self, training: Training, attempt: Any) -> None:
        """Live: the rounds entered, and the cut."""
        self.note_rounds(training)
        self.maybe_cut(training)

    def note_rounds(self, training: Training) -> None:
        """Append the rounds this process entered since the last call to ``<record>.rounds``."""
        events, record = training.events, self.args.record_samples
        if record is None or not training.live or len(events) == self.rounds_seen:
            return
        self.rounds_seen = len(events)
        line = {"pid": os.getpid(), "rank": training.rank, "world": training.world}
        line |= {"round": events[-1].round.number if events else None, "step": training.step}
        line |= {"model": id(training.model)}  # the object: a survivor keeps its model across round changes
        with record.with_suffix(".rounds").open("a") as fh:
            fh.write(json.dumps(line) + "\n")

    def maybe_cut(self, training: Training) -> None:
        """``--cut-at``: the chosen rank shuts down its connections to the peers' workers (once per process)."""
        a = self.args
        if self.cut or not training.live or a.cut_at != training.step + 1 or a.cut_rank != training.rank:
            return
        self.cut = True
        cut = cut_peer_connections(round_store_port())
        print(f"train_driver: rank {training.rank} cut {cut} peer connection(s) before step {a.cut_at}", flush=True)

    def before_step(self, training: Training, attempt: Any) -> None:
        """Plain: the hold after the last commit's checkpoint, then the hang."""
        if training.step >= training.total or training.live:
            return
        hold(self.args.hold_file, training.step, training.device)
        self.maybe_hang(training)

    def maybe_hang(self, training: Training) -> None:
        """``--hang-at``: the chosen rank stops making progress (a first attempt only: the restart trains on)."""
        a = self.args
        if a.hang_at != training.step + 1 or a.hang_rank != training.rank or training.resumed != 0:
            return
        if a.record_samples is not None:
            a.record_samples.with_suffix(".hang").write_text(str(time.time()))
        print(f"train_driver: rank {training.rank} hangs before step {training.step + 1}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)

    def checkpoint_phase(self, training: Training, phase: str, step: int) -> None:
        """Freeze this process where ``--freeze-file`` says (once)."""
        where = "manifest" if training.rank == 0 else "snapshot"  # rank 0: before the commit; others: before writing
        if (
            self.args.freeze_file is not None
            and phase == where
            and freeze_due(self.args.freeze_file, step, training.rank)
        ):
            os.kill(os.getpid(), signal.SIGSTOP)

    def after_step(self, training: Training, done: Done) -> None:
        """The record of the committed step, then (live) the hold."""
        self.record(training, done)
        self.hold_between_steps(training)

    def record(self, training: Training, done: Done) -> None:
        """The sample ids this rank trained on in the committed step, one JSON line (O_APPEND keeps lines whole)."""
        if self.args.record_samples is None:
            return
        fields = {"step": done.step, "rank": training.rank, "world": training.world, "pid": os.getpid()}
        fields |= {"attempt": self.attempt, "resumed": training.resumed, "started": self.started_at}
        fields |= {"load_s": training.load_s, "loaded": self.loaded, "time": time.time()}
        fields |= {"samples": [list(s) for s in done.samples], **self.entered(training), **self.entry(training)}
        with self.args.record_samples.open("a") as fh:
            fh.write(json.dumps(fields) + "\n")

    def entered(self, training: Training) -> dict[str, Any]:
        """On the first step committed in a round this process entered live: ``{"entered": {"round", "left",
        "ready"}}`` — when it left the old group and when the new round's state was in place (wall clock)."""
        events = training.events
        if len(events) == self.reported or events[-1].first_step_at is None:
            return {}
        self.reported, event = len(events), events[-1]
        wall = time.time() - time.monotonic()
        return {"entered": {"round": event.round.number, "left": event.left_at + wall, "ready": event.ready_at + wall}}

    def entry(self, training: Training) -> dict[str, Any]:
        """On the first step committed in each live round (the first one too): ``{"entry": {phase: seconds}}``, the
        round's entry split (:attr:`RoundState.entry <elasticzero.live.loop.RoundState.entry>`)."""
        now = training.rounds.now  # its number kept, not the round: a reference would keep a left round's model,
        if not training.live or now.round is None or now.round.number == self.entry_reported:  # optimizer, copies
            return {}
        self.entry_reported = now.round.number
        return {"entry": now.entry}


def round_store_port() -> int:
    """The port of the store of the round this worker is in (its connections to it are kept)."""
    from elasticzero.rounds import ROUND_FILE_ENV, NodeRound, RoundFile

    found = RoundFile(os.environ[ROUND_FILE_ENV]).poll(-1)
    assert isinstance(found, NodeRound), found
    return found.store.port


def cut_peer_connections(store_port: int) -> int:
    """Shut down (both directions) every established TCP connection of this process but those to or of the store at
    ``store_port``: the process group's connections to the peers' workers. How many."""
    import socket

    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        ports = {conn.laddr.port if conn.laddr else 0, conn.raddr.port if conn.raddr else 0}
        if conn.status != psutil.CONN_ESTABLISHED or store_port in ports or conn.fd < 0:
            continue
        with socket.socket(fileno=os.dup(conn.fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)  # acts on the connection itself, not only this descriptor
        cut += 1
    return cut


def process_start() -> float:
    """This process's start on the ``time.time()`` clock, to the kernel's clock tick: its start in ticks since boot
    (``/proc/self/stat``) against the boot clock now. psutil's ``create_time`` adds the start to the boot time, which
    the kernel reports in whole seconds: every start would be off by the same up to 1 s, enough to misplace a worker
    start beside an event measured with ``time.time()`` (the recovery benches' splits)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, after the name
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, IndexError, ValueError):  # no procfs: psutil's, whole-second boot time and all
        return float(psutil.Process().create_time())


def attempt_id(device: torch.device) -> int:
    """One id per (re)start of the job, the same on every rank and larger at each restart (rank 0's clock); the
    broadcast runs on the worker's device (NCCL has no CPU tensors)."""
    stamp = torch.tensor(time.time_ns(), dtype=torch.int64, device=device)
    dist.broadcast(stamp, 0)
    return int(stamp.item())


def hold(path: Path | None, step: int, device: torch.device) -> None:
    """Wait (collectively: a lost peer fails the job) while ``path`` exists and names a step <= ``step``; a held job
    tells the agent it is alive (``elasticzero.heartbeat()``: a pause of the loop's own, not a hang)."""
    while path is not None:
        flag = torch.tensor(int(dist.get_rank() == 0 and held(path, step)), device=device)
        dist.broadcast(flag, 0)
        if not flag.item():
            return
        elasticzero.heartbeat()
        time.sleep(0.2)


def freeze_due(path: Path, step: int, rank: int) -> bool:
    """``path`` names this step and rank: claim it (rename to ``.fired``, so it fires once) and say so."""
    try:
        due = path.read_text().split() == [str(step), str(rank)]
        if due:
            os.replace(path, path.with_name(path.name + ".fired"))
        return due
    except FileNotFoundError:
        return False


def held(path: Path, step: int) -> bool:
    try:
        return int(path.read_text().strip() or 0) <= step
    except (FileNotFoundError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    ours, theirs = parser().parse_known_args(argv)
    return train_gpt.main(theirs, hooks=[Driven(ours)])


if __name__ == "__main__":
    torch.set_num_threads(1)  # the ranks of a test share this machine's cores
    raise SystemExit(main())
