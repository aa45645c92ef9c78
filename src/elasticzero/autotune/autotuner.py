"""The tuning loop: the tuner's proposals → the schedule → experiments → the journal, until the tuner is done.

Everything it decides with is pure (:mod:`.tuners`, :mod:`.schedule`, :mod:`.outcome`, :mod:`.journal` replay);
this module only wires them to the :class:`~elasticzero.autotune.runner.TrialLauncher` and the clock. It blocks on
the launcher's event queue (an experiment's exit) with the nearest per-experiment deadline as the wait's timeout —
no fixed polling interval.

Stopping: the tuner has nothing left; or early stopping (``early_stopping`` experiments without a clear
improvement); or the wall-time budget (``time_budget``) is spent — then no new experiment starts and the running ones
finish (bounded by their timeout). A trial that reports ``ok`` without the tuned metric stops the run with a
:class:`UsageError` (exit 2): the script never reports that metric.
"""

from __future__ import annotations

import json
import queue
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import hjson

from elasticzero.autotune.contract import read_report
from elasticzero.autotune.dialect import apply_point
from elasticzero.autotune.experiment import Experiment, mapped_entry, with_flag
from elasticzero.autotune.journal import Journal
from elasticzero.autotune.outcome import Outcome, classify
from elasticzero.autotune.resources import Request, ResourceManager
from elasticzero.autotune.runner import Running, TrialLauncher, kill_job_everywhere
from elasticzero.autotune.schedule import decide
from elasticzero.autotune.space import Point, TuningSpec
from elasticzero.autotune.tuners import Candidate, best, make_tuner, stalled
from elasticzero.errors import UsageError

__all__ = ["Autotuner", "Setup", "TuningResult"]


@dataclass
class Setup:
    """Everything decided before anything runs (built by :func:`elasticzero.autotune.cli.prepare`)."""

    spec: TuningSpec
    points: list[Point]
    skipped: list[tuple[str, str]]
    base_config: dict[str, Any]
    deepspeed: bool
    config_suffix: str  # ".yaml" or ".json": the trial configs keep the user's format
    entry: tuple[str, ...]
    config_flag: str
    request: Request
    manager: ResourceManager
    launch_flags: list[str]
    base_port: int
    results_dir: Path
    train_batch_size: int
    fresh: bool = False
    retry_failed: bool = False  # on resume, run experiments that ended in error/timeout again (OOMs stay)
    invalid: dict[Point, str] = field(default_factory=dict)  # points whose trial config does not validate

    def experiment(self, cand: Candidate) -> Experiment:
        config = apply_point(self.base_config, cand.point, self.deepspeed, self.train_batch_size)
        entry = mapped_entry(self.entry, config, self.spec.arg_mappings)
        r = self.request
        return Experiment(
            cand.point,
            config,
            entry,
            r.nodes,
            r.slots_per_node,
            self.spec.warmup_steps,
            cand.steps,
            dict(self.spec.arg_mappings),
            cand.rung,
        )


@dataclass
class TuningResult:
    """The history in finishing order and the best experiment (``None`` when nothing succeeded)."""

    history: list[tuple[Candidate, Outcome, Experiment]]
    best: tuple[Candidate, Outcome, Experiment] | None
    stopped_because: str
    elapsed: float


class Autotuner:
    """Runs a :class:`Setup` to completion (see the module docstring)."""

    def __init__(
        self,
        setup: Setup,
        launcher: TrialLauncher,
        out: TextIO = sys.stdout,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.s = setup
        self.launcher = launcher
        self.out = out
        self.clock = clock
        self.tuner = make_tuner(setup.spec)
        self.journal = Journal(setup.results_dir / "journal.jsonl")
        self.history: list[tuple[Candidate, Outcome, Experiment]] = []
        self.running: dict[str, tuple[Running, Candidate, Experiment]] = {}
        self.stored: dict[str, Outcome] = {}
        self.port_counter = 0
        self.tuning_id = f"ezat-{secrets.token_hex(3)}"
        self.started = 0
        self.t0 = 0.0

    # ------------------------------------------------------------------ main loop
    def run(self) -> TuningResult:
        self.t0 = self.clock()
        self._resume()
        stopped = "the tuner has no experiment left"
        while True:
            wanted = self._wanted()
            reason = self._stop_reason()
            if reason and not self.running:
                stopped = reason
                break
            queue_ = [] if reason else [(self._key(c), c) for c in wanted if self._key(c) not in self.running]
            if not queue_ and not self.running:
                break
            self._start(queue_)
            self._wait_one()
        found = best([(c, o) for c, o, _ in self.history], self.s.spec.metric)
        top = next((h for h in self.history if found and h[0] == found[0]), None)
        return TuningResult(self.history, top, stopped, self.clock() - self.t0)

    def _key(self, cand: Candidate) -> str:
        return self.s.experiment(cand).key

    def _wanted(self) -> list[Candidate]:
        """The tuner's proposals, after folding in results the journal already holds (those never run again)."""
        while True:
            cands = self.tuner.propose(self.s.points, [(c, o) for c, o, _ in self.history])
            cands = [c for c in cands if c.point not in self.s.invalid]
            known = [c for c in cands if self._key(c) in self.stored]
            if not known:
                return cands
            for c in known:
                self._record(c, self.s.experiment(c), self.stored.pop(self._key(c)), journal=False)

    def _stop_reason(self) -> str | None:
        spec = self.s.spec
        if spec.time_budget is not None and self.clock() - self.t0 >= spec.time_budget:
            return f"the time budget of {spec.time_budget:g} s is spent"
        if stalled([(c, o) for c, o, _ in self.history], spec.metric, spec.early_stopping, spec.noise):
            return f"early stopping: {spec.early_stopping} experiments without a clear improvement"
        return None

    # ------------------------------------------------------------------ resume
    def _resume(self) -> None:
        if self.s.fresh:
            aside = self.journal.start_fresh()
            if aside:
                self._say(f"--fresh: previous journal kept as {aside}")
        state = self.journal.load()
        self.stored = {k: Outcome.from_json(v) for k, v in state.finished.items()}
        if self.s.retry_failed:
            retried = [k for k, o in self.stored.items() if o.status in ("error", "timeout")]
            self.stored = {k: o for k, o in self.stored.items() if k not in retried}
            if retried:
                self._say(f"--retry-failed: {len(retried)} failed experiment(s) run again")
        for key, start in state.interrupted.items():  # the tuner died while these ran: clean up, then re-run
            hosts, job = start.get("hosts") or [], start.get("job_id")
            if job:
                kill_job_everywhere(hosts, str(job), self.launcher.python, self.launcher.ssh)
            self._say(f"resume: {start.get('name', key)} was running when the tuner stopped; it runs again")
        if self.stored:
            self._say(f"resume: {len(self.stored)} finished experiment(s) in {self.journal.path} are not run again")

    # ------------------------------------------------------------------ start / wait / finish
    def _start(self, queue_: list[tuple[str, Candidate]]) -> None:
        ports = {r.port for r, _, _ in self.running.values()}
        starts, self.port_counter = decide(
            [(k, self.s.request) for k, _ in queue_],
            self.s.manager,
            running=len(self.running),
            max_running=None,
            base_port=self.s.base_port,
            port_counter=self.port_counter,
            ports_in_use=ports,
        )
        by_key = dict(queue_)
        for st in starts:
            cand = by_key[st.key]
            exp = self.s.experiment(cand)
            self.started += 1
            job_id = f"{self.tuning_id}-{self.started}"
            directory = self.s.results_dir / "exps" / exp.dirname
            self._write_experiment(directory, exp)
            self.journal.append(
                {
                    "event": "start",
                    "key": exp.key,
                    "name": exp.name,
                    "job_id": job_id,
                    "hosts": list(st.reservation.hosts),
                }
            )
            self.s.manager.reserve(st.reservation)
            entry = self._entry_with_config(exp, directory)
            run = self.launcher.start(
                exp.key,
                entry,
                st.reservation,
                st.port,
                job_id,
                directory,
                exp.warmup_steps,
                exp.steps,
                self.s.spec.timeout,
            )
            self.running[exp.key] = (run, cand, exp)
            self._say(f"start {exp.name} on {','.join(st.reservation.hosts)} (job {job_id}, port {st.port})")

    def _entry_with_config(self, exp: Experiment, directory: Path) -> list[str]:
        path = directory / f"config{self.s.config_suffix}"
        return [exp.entry[0], *with_flag(exp.entry[1:], self.s.config_flag, str(path))]

    def _write_experiment(self, directory: Path, exp: Experiment) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "exp.hjson").write_text(hjson.dumps(exp.to_record(), indent=2) + "\n")
        (directory / f"config{self.s.config_suffix}").write_text(dump_config(exp.config, self.s.config_suffix))

    def _wait_one(self) -> None:
        if not self.running:
            return
        nearest = min(r.deadline for r, _, _ in self.running.values())
        try:
            key, code = self.launcher.events.get(timeout=max(0.0, nearest - self.clock()))
        except queue.Empty:
            pass
        else:
            self._finish(key, code)
        self._time_out_expired()

    def _time_out_expired(self) -> None:
        now = self.clock()
        for run, _, exp in list(self.running.values()):
            if run.deadline <= now and not run.timed_out:
                run.timed_out = True
                self._say(f"timeout: {exp.name} ran {self.s.spec.timeout:g} s; killing job {run.job_id}")
                for err in self.launcher.kill(run):
                    self._say(f"could not kill job {run.job_id} on {err}; run elasticzero-run --kill-job there")
                run.deadline = float("inf")  # its exit event follows the kill

    def _finish(self, key: str, code: int) -> None:
        run, cand, exp = self.running.pop(key)
        self.s.manager.release(run.reservation)
        seconds = self.clock() - run.started
        report = read_report(run.directory / "metrics.json")
        outcome = classify(code, report, run.timed_out, self.s.spec.metric, seconds, self.s.spec.timeout)
        (run.directory / "exit.json").write_text(json.dumps({"exit_code": code, **outcome.to_json()}, indent=1) + "\n")
        if outcome.missing_metric:
            self._abort(exp, outcome)
        self._record(cand, exp, outcome, journal=True)

    def _abort(self, exp: Experiment, outcome: Outcome) -> None:
        for run, _, _ in self.running.values():
            self.launcher.kill(run)
        raise UsageError(
            f"{exp.name}: {outcome.reason}; the script must report autotuning.metric "
            f"{self.s.spec.metric.name!r} (or choose a metric it reports)"
        )

    def _record(self, cand: Candidate, exp: Experiment, outcome: Outcome, journal: bool) -> None:
        if journal:
            self.journal.append({"event": "finish", "key": exp.key, "name": exp.name, "outcome": outcome.to_json()})
        self.history.append((cand, outcome, exp))
        self._progress(exp, outcome, journal)

    # ------------------------------------------------------------------ progress
    def _progress(self, exp: Experiment, outcome: Outcome, ran: bool) -> None:
        metric = self.s.spec.metric
        value = outcome.metrics.get(metric.name)
        what = (
            f"{value:.4g} {metric.unit}" if outcome.ok and value is not None else f"{outcome.status}: {outcome.reason}"
        )
        done = len(self.history)
        failed = sum(1 for _, o, _ in self.history if not o.ok)
        found = best([(c, o) for c, o, _ in self.history], metric)
        best_txt = f"{found[0].point.name} {found[1].metrics[metric.name]:.4g}" if found else "-"
        proposals = self.tuner.propose(self.s.points, [(c, o) for c, o, _ in self.history])
        queued = sum(1 for c in proposals if self._key(c) not in self.running)
        elapsed = self.clock() - self.t0
        durations = [o.seconds for _, o, _ in self.history if o.seconds > 0]
        parallel = max(1, len(self.s.manager.nodes) // self.s.request.nodes)  # experiments that fit side by side
        eta = sum(durations) / len(durations) * (queued + len(self.running)) / parallel if durations else 0.0
        tag = "" if ran else " (from the journal)"
        self._say(
            f"{exp.name}: {what}{tag} | done {done} running {len(self.running)} queued {queued} "
            f"failed {failed} | best {best_txt} | elapsed {elapsed:.0f}s ETA ~{eta:.0f}s"
        )

    def _say(self, text: str) -> None:
        print(f"elasticzero-autotune: {text}", file=self.out, flush=True)


def dump_config(config: dict[str, Any], suffix: str) -> str:
    """A trial config as text in the user's format (YAML, or JSON which hjson readers accept too)."""
    if suffix == ".yaml":
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create(config))
    return json.dumps(config, indent=2) + "\n"
