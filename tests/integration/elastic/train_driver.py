"""The example job (``examples/train_gpt.py``) with the hooks of the elastic tests and benchmarks around its trainer.

Run it as the example is run (under ``elasticzero-run``, or directly: a world of one), with the example's flags and:

- ``--record-samples FILE``: after every optimizer step each rank appends one JSON line ``{"step", "rank", "world",
  "attempt", "resumed", "started", "load_s", "loaded", "time", "samples": [[epoch, id], ...]}`` (``loaded``: when
  the resume finished and training began, wall clock) (docs/elastic-training.md, "The
  sample record");
- ``--hold-file FILE``: before step N+1 (after step N and its checkpoint; live: before that checkpoint) the job waits
  while FILE exists and holds a number <= N, collectively (a lost peer fails the job; live: each rank, polling the
  round file). A test holds the job at a known step this way;
- ``--hang-at N --hang-rank R``: in an attempt that started from step 0, rank R stops making progress before step N
  (after the hold): it writes the wall-clock instant to ``<--record-samples>.hang`` and sleeps for good, while its
  peers go on into step N's collectives. The hang tests' hung worker;
- ``--freeze-file FILE``: when FILE holds ``STEP RANK``, rank RANK stops itself (SIGSTOP) inside the checkpoint save of
  step STEP — rank 0 right before its commit, any other rank right before it writes its files — after renaming FILE
  to ``FILE.fired`` (once). A test then freezes the rest of that node and resumes it later (fencing).

:class:`DrivenTrainer` subclasses the example's ``Trainer``: the example's own loop runs, the hooks wrap its
``load`` and ``train_step``. Under ``elasticzero-run --live-recovery`` :class:`DrivenLiveTrainer` does the same for
the example's ``LiveTrainer`` (the record and the hold; its lines name the worker's ``pid`` instead of an attempt).
Used by ``test_elastic_e2e.py``, ``test_live_e2e.py`` and ``bench/elastic_recovery_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

import elasticzero

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))  # the example job and its gpt.py
import train_gpt


class DrivenTrainer(train_gpt.Trainer):
    """The example's trainer, recording each step's samples and holding at the step a file names."""

    @staticmethod
    def parser() -> argparse.ArgumentParser:
        p = train_gpt.Trainer.parser()
        p.add_argument("--record-samples", type=Path, help="append each step's sample ids per rank to this JSONL file")
        p.add_argument("--hold-file", type=Path, help="before step N+1, wait while this file holds a number <= N")
        p.add_argument("--hang-at", type=int, help="rank --hang-rank sleeps for good before this step (first attempt)")
        p.add_argument("--hang-rank", type=int, default=0, help="the rank --hang-at hangs (default 0)")
        p.add_argument("--freeze-file", type=Path, help="'STEP RANK': that rank SIGSTOPs itself in that step's save")
        return p

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        super().__init__(args, device)
        self.recording = args.record_samples is not None
        if self.recording:
            self.loader.sampler.record = []  # (epoch, index) of every sample this rank trains on
        self.started = process_start()  # this worker process's start (wall clock)
        self.attempt, self.resumed, self.load_s, self.loaded = 0, 0, 0.0, 0.0
        if args.freeze_file is not None and self.ckpt:  # the example's Checkpointer, rebuilt with the freeze hook
            self.ckpt.close()
            hook, directory = self.phase, args.checkpoint_dir
            self.ckpt = train_gpt.Checkpointer(directory, keep_last=2, async_save=args.async_save, phase_hook=hook)

    def phase(self, phase: str, step: int) -> None:
        """The checkpoint's phase hook: freeze this process where ``--freeze-file`` says (once)."""
        where = "manifest" if self.rank == 0 else "snapshot"  # rank 0: before the commit; others: before writing
        if phase == where and freeze_due(self.args.freeze_file, step, self.rank):
            os.kill(os.getpid(), signal.SIGSTOP)

    def load(self) -> int:
        t0 = time.perf_counter()
        self.resumed = super().load()
        self.load_s, self.loaded = time.perf_counter() - t0, time.time()
        self.attempt = attempt_id(self.device)
        return self.resumed

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        hold(self.args.hold_file, self.step - 1, self.device)
        self.maybe_hang()
        loss = super().train_step(batches)
        if self.recording:
            self.record()
        return loss

    def evaluate(self, global_batches: int = 2) -> None:
        """The example's evaluation, told to the agent as progress (a pause of the loop's own, not a hang)."""
        elasticzero.heartbeat()
        super().evaluate(global_batches)
        elasticzero.heartbeat()

    def maybe_hang(self) -> None:
        """``--hang-at``: the chosen rank stops making progress (a first attempt only: the restart trains on)."""
        a = self.args
        if a.hang_at != self.step or a.hang_rank != self.rank or self.resumed != 0:
            return
        if a.record_samples is not None:
            a.record_samples.with_suffix(".hang").write_text(str(time.time()))
        print(f"train_driver: rank {self.rank} hangs before step {self.step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)

    def record(self) -> None:
        """The sample ids this rank trained on in this step, one JSON line (O_APPEND keeps the ranks' lines whole)."""
        sampler = self.loader.sampler
        assert sampler.record is not None
        samples, sampler.record[:] = list(sampler.record), []
        fields = {"step": self.step, "rank": self.rank, "world": self.world, "attempt": self.attempt}
        fields |= {"resumed": self.resumed, "started": self.started, "load_s": self.load_s, "loaded": self.loaded}
        fields["time"] = time.time()
        with self.args.record_samples.open("a") as fh:
            fh.write(json.dumps({**fields, "samples": samples}) + "\n")


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


class DrivenLiveTrainer(train_gpt.LiveTrainer):
    """The example's live trainer (``elasticzero-run --live-recovery``) with the record and the hold of
    :class:`DrivenTrainer`: each committed step one JSON line per rank (``pid``: a survivor keeps its process), and
    the hold (before the checkpoint) waits polling the round file, so a membership change during it is taken at once."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.started, self.samples, self.reported = process_start(), [], 0

    def save_due(self, live: Any, run: Callable[[Callable[[], None]], bool | None]) -> bool:
        """The hold comes first in the attempt, before the last commit's checkpoint: a round change during it lands
        between a save step's commit and its save (the join race of issue 21)."""
        while live.step < self.args.steps and self.args.hold_file is not None and held(self.args.hold_file, live.step):
            live.bound.check()  # a new round: leave the hold for it
            elasticzero.heartbeat()
            time.sleep(0.05)
        return super().save_due(live, run)

    def live_step(self, attempt: Any) -> torch.Tensor:
        attempt.check()  # a round written before the hold was lifted (while this slept) is taken before the step
        epoch = attempt.live.sampler.epoch
        self.samples = [[epoch, i] for mb in attempt.micro_batches for i in mb]
        return super().live_step(attempt)

    def end_step(self, live: Any, loss: torch.Tensor, start: int, t0: float) -> None:
        if self.args.record_samples is not None:  # the step committed: its samples, once
            fields = {"step": live.step, "rank": self.rank, "world": self.world, "pid": os.getpid()}
            fields |= {"started": self.started, "time": time.time(), "samples": self.samples}
            fields |= self.entered(live)
            with self.args.record_samples.open("a") as fh:
                fh.write(json.dumps(fields) + "\n")
        super().end_step(live, loss, start, t0)

    def entered(self, live: Any) -> dict[str, Any]:
        """On the first step committed in a round this process entered live: ``{"entered": {"round", "left",
        "ready"}}`` — when it left the old group and when the new round's state was in place (wall clock)."""
        if len(live.events) == self.reported or live.events[-1].first_step_at is None:
            return {}
        self.reported, event = len(live.events), live.events[-1]
        wall = time.time() - time.monotonic()
        return {"entered": {"round": event.round.number, "left": event.left_at + wall, "ready": event.ready_at + wall}}


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


if __name__ == "__main__":
    torch.set_num_threads(1)  # the ranks of a test share this machine's cores
    raise SystemExit(train_gpt.main(trainer=DrivenTrainer, live=DrivenLiveTrainer))
