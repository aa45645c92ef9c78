"""elasticzero-autotune with real processes: 2 gloo ranks per experiment on the local backend, tiny model.

The trial script (``at_trial.py``) has a known cost per configuration far above timing noise, so "picks the best" is
checked against the cost model, not against a hard-coded figure. Synchronisation is on the journal file and on
process exit, never on sleeps. Trials import no torch (the contract is framework-agnostic; a torch import per rank
is most of a trial's cost here) except one experiment of ``test_launch_autotuning_run_minimises_latency``, a real
torch/gloo job.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from elasticzero.agent.proctree import processes_with_env, wait_gone
from ez_testing import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

TRIAL = str(Path(__file__).with_name("at_trial.py"))
BASE = """zero: {stage: 1}
micro_batch_size: 1
accumulation_steps: 4
train_batch_size: 8
optimizer: {type: SGD, params: {lr: 0.1}}
"""


def _argv(prog: str = "autotune") -> list[str]:
    head = (
        [sys.executable, "-m", "elasticzero.autotune.cli"]
        if prog == "autotune"
        else [
            sys.executable,
            "-m",
            "elasticzero.entry",  # the console script elasticzero-launch
            "--autotuning",
            prog,
        ]
    )
    return [*head, "--nproc-per-node", "2", "--master-port", str(free_port()), TRIAL, "--config", "cfg.yaml"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EZ_AT_", "ELASTICZERO_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _journal(results: Path) -> list[dict]:
    path = results / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _finished(records: list[dict]) -> list[str]:
    return [r["name"] for r in records if r["event"] == "finish"]


def _no_job_processes(records: list[dict]) -> None:
    jobs = {r["job_id"] for r in records if r["event"] == "start"}
    for job in jobs:
        left = processes_with_env("ELASTICZERO_JOB_ID", job)
        assert not wait_gone([p.pid for p in left], timeout=30), f"processes of {job} remain"


def _wait_for_finishes(proc: subprocess.Popen, results: Path, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_finished(_journal(results))) < n:
        assert proc.poll() is None, "the tuner ended before it was killed"
        assert time.monotonic() < deadline, f"fewer than {n} experiments finished in {timeout} s"
        time.sleep(0.2)  # re-reading a file the tuner fsyncs; the condition is the journal's content


def test_grid_resumes_after_sigkill_and_picks_the_best(tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text(
        BASE + "autotuning: {tuner: grid, space: {stage: [1, 2], micro_batch: [4]}, warmup_steps: 1, "
        "measure_steps: 4, timeout: 300}\n"
    )
    results = tmp_path / "autotuning_results"
    env = _env()
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(_argv(), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for_finishes(first, results, 1, timeout=300)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
    before = _journal(results)
    _no_job_processes(before)  # the running experiment's launcher died with the tuner and took its job along
    done_before = _finished(before)

    p = subprocess.run(_argv(), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resume: {len(done_before)} finished experiment(s)" in p.stdout
    records = _journal(results)
    finished = _finished(records)
    assert sorted(finished) == sorted(set(finished)), "an experiment that had finished ran again"
    assert sorted(finished) == ["z1_mb4_ga1", "z2_mb4_ga1"]
    best = OmegaConf.to_container(OmegaConf.load(results / "best_config.yaml"))
    assert (best["zero"]["stage"], best["micro_batch_size"], best["accumulation_steps"]) == (1, 4, 1)  # cost model
    assert "autotuning" not in best
    rows = {r["name"]: r for r in csv.DictReader(open(results / "results.csv"))}
    assert rows["z2_mb4_ga1"]["status"] == "ok"  # printed "error" on stderr and exited 0 with status ok
    assert b"error: this stderr line is noise" in next(results.glob("exps/z2_mb4_ga1-*/stderr.log")).read_bytes()
    summary = (results / "summary.txt").read_text()
    assert "BEST: z1_mb4_ga1" in summary and "best stage 2: z2_mb4_ga1" in summary
    assert "--config " + str(results / "best_config.yaml") in (results / "best_command.txt").read_text()
    _no_job_processes(records)


def test_model_based_oom_prunes_larger_micro_batches(tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text(
        BASE + "autotuning: {space: {stage: [1, 2], micro_batch: [1, 2, 4]}, warmup_steps: 1, min_steps: 2, "
        "measure_steps: 4, timeout: 300}\n"
    )
    p = subprocess.run(_argv(), cwd=tmp_path, env=_env(EZ_AT_OOM="2:2"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    records = _journal(results)
    # the descent starts at the lowest stage with the largest micro batch and walks down past the OOMs, then tries
    # the neighbours of the best; the OOM at z2 mb2 rules out z2 mb4, which never starts
    started = [r["name"] for r in records if r["event"] == "start"]
    assert started == ["z1_mb4_ga1", "z1_mb2_ga2", "z1_mb1_ga4", "z2_mb1_ga4", "z2_mb2_ga2"]
    outcomes = {r["name"]: r["outcome"] for r in records if r["event"] == "finish"}
    assert [outcomes[n]["status"] for n in started] == ["oom", "oom", "ok", "ok", "oom"]
    assert "injected OOM" in outcomes["z2_mb2_ga2"]["reason"]
    summary = (results / "summary.txt").read_text()
    assert "pruned z2_mb4_ga1: OOM at z2_mb2_ga2" in summary and "BEST: z1_mb1_ga4" in summary


def test_launch_autotuning_run_minimises_latency(tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text(
        BASE + "autotuning: {tuner: grid, metric: latency, space: {micro_batch: [1, 4]}, warmup_steps: 1, "
        "measure_steps: 3}\n"
    )
    env = _env(EZ_AT_REPORT="direct", EZ_AT_TORCH="1:4")  # z1_mb4_ga1 is the real path: torch model, gloo
    p = subprocess.run(_argv("run"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # latency per micro-batch: micro batch 1 (throughput would have chosen micro batch 4, one micro-batch a step)
    assert "BEST: z1_mb1_ga4" in p.stdout
    assert "training with the best config (autotuning off)" in p.stdout
    assert len(_finished(_journal(tmp_path / "autotuning_results"))) == 2  # the final run is not an experiment
    real = next((tmp_path / "autotuning_results").glob("exps/z1_mb4_ga1-*/stderr.log")).read_text()
    assert real.count("real torch trial: gloo world 2") == 2


@pytest.fixture(scope="module", autouse=True)
def hung_tuning(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A tuning run started with the module (its hung experiment sleeps out its timeout, taking no CPU, while the
    other tests run); ``test_hung_experiment_is_killed_then_missing_metric_stops`` checks how it ended.

    Grid order: z1_mb1_ga4 exits 0 without a report; z1_mb2_ga2 hangs as soon as it has read its config; then
    z1_mb4_ga1 reports without the tuned metric. The one timeout of all three must cover z1_mb1_ga4's whole run
    (launcher, agent with torch, 2 ranks without) — 5 s quiet, over 15 s once at CI's load (it then ended as a
    timeout, not an error) — so 60 s: the hung experiment sleeps it out without CPU, beside the module's other tests,
    which take longer.
    """
    cwd = tmp_path_factory.mktemp("hung")
    (cwd / "cfg.yaml").write_text(
        BASE + "autotuning: {tuner: grid, metric: flops, space: {micro_batch: [1, 2, 4]}, warmup_steps: 1, "
        "measure_steps: 2, timeout: 60}\n"
    )
    with open(cwd / "out.log", "wb") as out, open(cwd / "err.log", "wb") as err:
        env = _env(EZ_AT_HANG="1:2", EZ_AT_NOREPORT="1:1")
        proc = subprocess.Popen(_argv(), cwd=cwd, env=env, stdout=out, stderr=err)
    try:
        yield proc, cwd
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_hung_experiment_is_killed_then_missing_metric_stops(hung_tuning: tuple[subprocess.Popen, Path]) -> None:
    proc, cwd = hung_tuning
    code = proc.wait(timeout=600)
    err = (cwd / "err.log").read_text()
    assert code == 2, err[-3000:]  # the second experiment's report has no flops: the run stops, exit 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("elasticzero-autotune: error: z1_mb4_ga1: the report has no metric 'flops' (reported: ")
    records = _journal(cwd / "autotuning_results")
    assert [r["name"] for r in records if r["event"] == "start"] == ["z1_mb1_ga4", "z1_mb2_ga2", "z1_mb4_ga1"]
    # the run stopped on the missing metric without journaling z1_mb4_ga1: fixed and resumed, it runs again
    finished = {r["name"]: r["outcome"] for r in records if r["event"] == "finish"}
    assert [(name, o["status"]) for name, o in finished.items()] == [("z1_mb1_ga4", "error"), ("z1_mb2_ga2", "timeout")]
    assert "without writing its report" in finished["z1_mb1_ga4"]["reason"]  # exit 0 is not success without one
    assert sorted(x.name for x in cwd.glob("hanging-*")) == ["hanging-0", "hanging-1"]  # it did hang
    _no_job_processes(records)  # the hung ranks ignored SIGTERM: the job-id scoped kill got them anyway
