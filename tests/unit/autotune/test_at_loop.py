"""The tuning loop's decisions with an in-process launcher: each "experiment" writes its report and exits at once.

What the loop decides is checked here without processes: resume from the journal, the wall-time budget, early
stopping, the stop on a metric that is never reported. Real processes are in tests/integration/autotune.
"""

from __future__ import annotations

import io
import json
import queue
from pathlib import Path

import pytest

from elasticzero.autotune import cli
from elasticzero.autotune.autotuner import Autotuner
from elasticzero.autotune.resources import Reservation
from elasticzero.autotune.runner import Running
from elasticzero.errors import UsageError


class InstantLauncher:
    """Writes ``metrics(point_name)`` as the report and posts exit 0; counts what it started."""

    def __init__(self, metrics, clock) -> None:
        self.metrics, self.clock = metrics, clock
        self.events: queue.Queue[tuple[str, int]] = queue.Queue()
        self.started: list[str] = []
        self.python, self.ssh = "python", ["ssh"]

    def start(self, key, entry, reservation: Reservation, port, job_id, directory: Path, warmup, steps, timeout):
        name = directory.name.rsplit("-", 1)[0]
        self.started.append(name)
        report = {"status": "ok", "metrics": self.metrics(name), "message": ""}
        (directory / "metrics.json").write_text(json.dumps(report))
        self.clock.now += 10.0  # every experiment takes 10 s of the fake clock
        self.events.put((key, 0))
        return Running(key, None, reservation, port, job_id, directory, self.clock.now, self.clock.now + timeout)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _tuner(tmp_path, block: str, metrics) -> tuple[Autotuner, InstantLauncher]:
    (tmp_path / "cfg.yaml").write_text(
        "zero: {stage: 1}\nmicro_batch_size: 1\naccumulation_steps: 8\ntrain_batch_size: 16\n"
        f"optimizer: {{type: SGD, params: {{lr: 0.1}}}}\nautotuning: {block}\n"
    )
    args, entry = cli.parse(["--nproc-per-node", "2", "t.py", "--config", "cfg.yaml"])
    setup = cli.prepare(args, entry, {}, str(tmp_path))
    clock = Clock()
    launcher = InstantLauncher(metrics, clock)
    return Autotuner(setup, launcher, out=io.StringIO(), clock=clock), launcher  # type: ignore[arg-type]


def _by_micro(name: str) -> dict[str, float]:
    micro = int(name.split("_")[1][2:])
    return {"throughput": 100.0 * micro}


def test_resume_skips_finished_and_budget_stops_new_starts(tmp_path) -> None:
    block = "{tuner: grid, space: {micro_batch: [1, 2, 4, 8]}, time_budget: 25}"
    at, launcher = _tuner(tmp_path, block, _by_micro)
    result = at.run()
    assert launcher.started == ["z1_mb1_ga8", "z1_mb2_ga4", "z1_mb4_ga2"]  # the third starts at 20 s < 25 s
    assert result.stopped_because == "the time budget of 25 s is spent"
    assert result.best[0].point.name == "z1_mb4_ga2"

    again, launcher2 = _tuner(tmp_path, block.replace("time_budget: 25", "time_budget: 100"), _by_micro)
    result2 = again.run()
    assert launcher2.started == ["z1_mb8_ga1"]  # the three finished ones come from the journal
    assert "resume: 3 finished experiment(s)" in again.out.getvalue()
    assert result2.best[0].point.name == "z1_mb8_ga1" and len(result2.history) == 4


def test_early_stopping(tmp_path) -> None:
    block = "{tuner: grid, space: {micro_batch: [8, 4, 2, 1]}, early_stopping: 2}"
    at, launcher = _tuner(tmp_path, block, _by_micro)
    result = at.run()
    assert launcher.started == ["z1_mb1_ga8", "z1_mb2_ga4", "z1_mb4_ga2", "z1_mb8_ga1"]  # each one improves
    flat = tmp_path / "flat"
    flat.mkdir()
    at2, launcher2 = _tuner(flat, block, lambda name: {"throughput": 1.0})
    result2 = at2.run()
    assert len(launcher2.started) == 3 and result2.stopped_because.startswith("early stopping: 2 experiments")
    assert result.stopped_because == "the tuner has no experiment left"


def test_metric_never_reported_stops_with_usage_error(tmp_path) -> None:
    at, launcher = _tuner(tmp_path, "{metric: flops, space: {micro_batch: [1, 2]}}", _by_micro)
    with pytest.raises(UsageError, match=r"z1_mb2_ga4: the report has no metric 'flops' \(reported: throughput\)"):
        at.run()
    assert launcher.started == ["z1_mb2_ga4"]  # the model-based tuner starts at the largest micro batch
    lines = (tmp_path / "autotuning_results" / "journal.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["start"]  # not journalled as finished: a fixed script reruns it


def test_retry_failed_reruns_errors_not_successes(tmp_path) -> None:
    block = "{tuner: grid, space: {micro_batch: [1, 2]}}"
    at, _ = _tuner(tmp_path, block, lambda name: {"latency": 1.0} if "mb2" in name else {"throughput": 5.0})
    with pytest.raises(UsageError, match="no metric 'throughput'"):
        at.run()  # mb2 reports the wrong metric: not journalled, so a plain resume runs it again anyway
    journal = tmp_path / "autotuning_results" / "journal.jsonl"
    with open(journal, "a") as f:  # an experiment that failed for a passing reason (e.g. a host was down)
        f.write(
            json.dumps({"event": "finish", "key": at._key(at.history[0][0]), "outcome": {"status": "error"}}) + "\n"
        )
    again, launcher = _tuner(tmp_path, block, _by_micro)
    again.run()
    assert launcher.started == ["z1_mb2_ga4"]  # the error stays an error without --retry-failed
    third, launcher3 = _tuner(tmp_path, block, _by_micro)
    third.s.retry_failed = True
    third.run()
    assert (
        launcher3.started == ["z1_mb1_ga8"]
        and "--retry-failed: 1 failed experiment(s) run again" in third.out.getvalue()
    )
