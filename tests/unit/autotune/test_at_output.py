"""The files a tuning run leaves: summary, results.csv, best config (+ DeepSpeed JSON), the command, the plot."""

from __future__ import annotations

import csv
import importlib.util
import json
import shlex
import sys

from elasticzero.autotune import cli
from elasticzero.autotune.autotuner import TuningResult
from elasticzero.autotune.outcome import Outcome
from elasticzero.autotune.output import summary_lines, write_outputs
from elasticzero.autotune.tuners import Candidate
from ez_testing import require

DS = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}


def _setup(tmp_path):
    block = {"tuner": "grid", "space": {"stage": [1, 2], "micro_batch": [1, 2, 3, 4]}}
    (tmp_path / "ds.json").write_text(json.dumps({**DS, "autotuning": block}))
    args, entry = cli.parse(["--nproc-per-node", "2", "train.py", "--deepspeed_config", "ds.json", "--x", "a b"])
    return cli.prepare(args, entry, {}, str(tmp_path))


def _result(setup) -> TuningResult:
    by_name = {p.name: p for p in setup.points}
    outcomes = {
        "z1_mb1_ga8": Outcome("ok", {"throughput": 10.0, "latency": 1.6, "steps": 10.0}, "", 0, 3.0),
        "z1_mb2_ga4": Outcome("oom", {}, "CUDA out of memory", 1, 2.0),
        "z2_mb1_ga8": Outcome("ok", {"throughput": 12.0}, "", 0, 3.0),
        "z2_mb2_ga4": Outcome("timeout", {}, "no result within 600 s", 137, 600.0),
    }
    hist = []
    for name, outcome in outcomes.items():
        cand = Candidate(by_name[name], 10)
        hist.append((cand, outcome, setup.experiment(cand)))
    return TuningResult(hist, hist[2], "the tuner has no experiment left", 609.0)


def test_summary_and_files(tmp_path) -> None:
    setup = _setup(tmp_path)
    setup.results_dir.mkdir()
    result = _result(setup)
    lines = summary_lines(setup, result)
    assert lines[0].startswith("autotuning: 4 experiment(s), tuner grid, metric throughput (maximised)")
    text = "\n".join(lines)
    assert "best stage 1: z1_mb1_ga8" in text and "best stage 2: z2_mb1_ga8" in text and "BEST: z2_mb1_ga8" in text
    assert "failed z1_mb2_ga4 (steps 10): oom: CUDA out of memory" in text
    assert "failed z2_mb2_ga4 (steps 10): timeout: no result within 600 s" in text
    assert "pruned z1_mb4_ga2: OOM at z1_mb2_ga4" in text  # never ran, ruled out by the memory model
    assert "left out z1_mb3: global batch 16 is not a multiple of micro batch 3 x world size 2" in text

    paths = write_outputs(setup, result, ["--nproc-per-node=2"])
    best = json.loads(paths["best_json"].read_text())
    assert best["zero_optimization"]["stage"] == 2 and "autotuning" not in best  # DeepSpeed JSON in, out
    assert paths["best_yaml"].exists()
    command = shlex.split(paths["command"].read_text())
    assert command == [
        "elasticzero-launch", "--nproc-per-node=2", "train.py", "--deepspeed_config", str(paths["best_json"]),
        "--x", "a b",
    ]  # fmt: skip
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [r["status"] for r in rows] == ["ok", "oom", "ok", "timeout"] and rows[0]["latency"] == "1.6"
    assert next(csv.reader(open(paths["csv"]))).count("steps") == 1  # the metric "steps" is not a second column


def test_plot_when_matplotlib_is_there_and_not(tmp_path, monkeypatch) -> None:
    setup = _setup(tmp_path)
    setup.results_dir.mkdir()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: skipped, no error
    assert "plot" not in write_outputs(setup, _result(setup), [])
    monkeypatch.undo()
    require(importlib.util.find_spec("matplotlib") is not None, "matplotlib not installed (the test extra has it)")
    paths = write_outputs(setup, _result(setup), [])
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
