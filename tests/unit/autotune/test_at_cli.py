"""``elasticzero-autotune`` bad input: one ``elasticzero-autotune: error: …`` line, exit code 2, nothing started.

Every case runs ``main()`` in-process on localhost's pool; a launch would need ``subprocess.Popen``, which is
replaced by a function that fails the test, so "nothing launched" is checked, not assumed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elasticzero.autotune import cli

NATIVE = """zero: {stage: 1}
micro_batch_size: 1
accumulation_steps: 4
train_batch_size: 8
optimizer: {type: SGD, params: {lr: 0.1}}
"""


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError(f"something was launched: {a}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def _run(tmp_path: Path, monkeypatch, capsys, tuning: str, extra: list[str] | None = None) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(NATIVE + tuning)
    argv = ["--nproc-per-node", "2", *(extra or []), "train.py", "--config", "cfg.yaml"]
    code = cli.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("tuning", "extra", "message"),
    [
        ("autotuning: {metrc: latency}\n", [], "cfg.yaml: autotuning: unknown key 'metrc'"),
        ("autotuning: {space: {}}\n", [], "empty search space"),
        ("autotuning: {metric: speed}\n", [], "unknown metric 'speed'"),
        ("autotuning: {nodes: 2}\n", [], r"needs 2 node(s) x 2 slot(s) but the pool has localhost:2"),
        ("autotuning: {slots_per_node: 4}\n", [], r"needs 1 node(s) x 4 slot(s)"),
        ("autotuning: {space: {micro_batch: [3]}}\n", [], "no usable point at global batch 8"),
        ("autotuning: {arg_mappings: {nope: --x}}\n", [], "config key 'nope' is not set"),
        ("", ["--no-ssh"], "--no-ssh: the tuner starts every experiment itself"),
        ("", ["--job-id", "x"], "--job-id: every experiment gets its own job id"),
        ("", ["--rdzv-endpoint", "etcd://e1"], "--rdzv-endpoint: each experiment's rendezvous runs on its"),
        ("", ["--save-pid"], "--save-pid is not supported with autotuning"),
        ("", ["--tuning", "missing.yaml"], "missing.yaml: cannot read config"),
        ("", ["--config-flag=--cfg"], "the script arguments have no --cfg FILE"),
        ("autotuning: {space: {stage: [7]}}\n", [], "ZeRO stage must be 0, 1, 2 or 3"),
        ("", ["--bogus"], "unknown option '--bogus'; see elasticzero-autotune --help"),  # names itself, not launch
        ("", ["--master-port", "x"], "'x' is not an integer; see elasticzero-autotune --help"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys, no_launch, tuning, extra, message) -> None:
    code, err = _run(tmp_path, monkeypatch, capsys, tuning, extra)
    assert code == 2
    assert err.startswith("elasticzero-autotune: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "autotuning_results").exists()


def test_invalid_trial_configs_are_left_out(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(NATIVE + "autotuning: {space: {stage: [1, 2], bucket_bytes: [1024]}}\n")
    args, entry = cli.parse(["--nproc-per-node", "2", "train.py", "--config", "cfg.yaml"])
    setup = cli.prepare(args, entry, {}, str(tmp_path))
    assert [p.name for p in setup.points] == ["z1_mb1_ga4_bkt1024", "z2_mb1_ga4_bkt1024"] and not setup.invalid
    assert setup.request.nodes == 1 and setup.request.slots_per_node == 2 and setup.config_suffix == ".yaml"
    assert setup.results_dir == tmp_path / "autotuning_results" and setup.config_flag == "--config"


def test_passthrough_rebuilds_launcher_flags() -> None:
    args, entry = cli.parse(
        ["--launcher", "pdsh", "--launcher-args", "-l me", "--export", "A", "--bind-cores-to-rank", "-m", "pkg.train"]
    )
    assert cli.passthrough(args) == [
        "--launcher=pdsh",
        "--launcher-args=-l me",
        "--export",
        "A",
        "--bind-cores-to-rank",
        "--module",
    ]
    assert entry == ["pkg.train"]


def test_deepspeed_migrants_flag_is_found(tmp_path) -> None:
    (tmp_path / "ds.json").write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2}}')
    args, entry = cli.parse(["--nproc-per-node", "2", "train.py", "--deepspeed", "--deepspeed_config", "ds.json"])
    setup = cli.prepare(args, entry, {}, str(tmp_path))
    assert setup.deepspeed and setup.config_flag == "--deepspeed_config" and setup.config_suffix == ".json"
    assert [p.name for p in setup.points] == ["z2_mb4_ga1"]


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, monkeypatch, capsys, no_launch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(NATIVE + "autotuning: {space: {stage: [1, 2], micro_batch: [1, 3]}}\n")
    code = cli.main(["--dry-run", "--nproc-per-node", "2", "--master-port", "30100", "t.py", "--config", "cfg.yaml"])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "autotuning_results").exists()
    assert "metric throughput (maximised), tuner model_based, 2 point(s) at global batch 8" in out
    assert "--include localhost:0,1 --master-port 30100" in out and "-- t.py --config cfg.yaml" in out
    assert "point z1_mb1_ga4" in out and "point z2_mb1_ga4" in out
    assert "left out z1_mb3: global batch 8 is not a multiple of micro batch 3 x world size 2" in out


def test_dry_run_json_is_the_checked_plan(tmp_path, monkeypatch, capsys, no_launch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(NATIVE + "autotuning: {metric: latency, space: {micro_batch: [1, 3, 4]}}\n")
    code = cli.main(
        ["--dry-run=json", "--nproc-per-node", "2", "--master-port", "30100", "t.py", "--config", "cfg.yaml"]
    )
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and not (tmp_path / "autotuning_results").exists()
    assert (shown["metric"], shown["maximize"], shown["tuner"], shown["train_batch_size"]) == (
        "latency",
        False,
        "model_based",
        8,
    )
    assert shown["pool"] == {"localhost": 2} and shown["resume"] is True
    assert [(p["name"], p["micro_batch"], p["accumulation"]) for p in shown["points"]] == [
        ("z1_mb1_ga4", 1, 4), ("z1_mb4_ga1", 4, 1)]  # fmt: skip
    assert shown["left_out"][0]["name"] == "z1_mb3"
    launch = shown["first_launch"]
    assert launch[launch.index("--") :] == ["--", "t.py", "--config", "cfg.yaml"] and "30100" in launch


def test_launch_autotuning_takes_the_tuners_flags(tmp_path, monkeypatch, capsys, no_launch) -> None:
    """``elasticzero-launch`` (the console script, :func:`elasticzero.entry.launch`) hands ``--autotuning`` to the
    tuner; the launcher alone (``python -m elasticzero.launch.cli``, the trials' launcher) refuses it in one line."""
    from elasticzero.entry import launch
    from elasticzero.launch import cli as launch_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(NATIVE)
    (tmp_path / "tune.yaml").write_text("metric: latency\nspace: {micro_batch: [1, 4]}\n")
    argv = ["--nproc-per-node", "2", "--fresh", "--results-dir", "out", "--tuning", "tune.yaml"]
    code = launch(["--autotuning", "tune", "--dry-run=json", *argv, "t.py", "--config", "cfg.yaml"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and (shown["metric"], shown["resume"]) == ("latency", False)
    assert shown["results_dir"] == str(tmp_path / "out") and not (tmp_path / "out").exists()
    assert launch([*argv, "t.py", "--config", "cfg.yaml"]) == 2  # a plain launch: nothing to tune
    err = capsys.readouterr().err
    assert "elasticzero-launch: error: --tuning is an autotuning flag: add --autotuning tune|run" in err
    assert launch_cli.main(["--autotuning", "tune", "--dry-run=json", *argv, "t.py", "--config", "cfg.yaml"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("elasticzero-launch: error: --autotuning tune: the tuner runs from the ")
    assert not (tmp_path / "out").exists()
