"""``elasticzero-launch --elastic-config FILE``: a plan whose ``--nnodes`` x slots allows a world size with no batch
plan is refused before anything starts (one line, exit 2); an agreeing plan launches (execution stubbed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elasticzero.launch.cli import main

Executions = Any  # the launch_env fixture (conftest.Executions): recorded execute() calls
CONFIG = "train_batch_size: 16\nmicro_batch_size: 4\n"  # valid world sizes 1, 2, 4


def _hosts(tmp_path: Path, slots: tuple[int, ...]) -> str:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"w{i} slots={n}\n" for i, n in enumerate(slots)))
    return str(path)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "slots", "nnodes", "expected"),
    [
        (CONFIG, (2, 2), "1:3", "--nnodes 1:3 x --nproc-per-node 2 allows world size(s) 6 "),
        (CONFIG, (1, 1, 1), "3", "--nnodes 3 x --nproc-per-node 1 allows world size(s) 3 "),
        # hosts with 2 and 1 slots: each count is checked as if every node had it (world 2 fits, world 4 not)
        (
            "train_batch_size: 6\nmicro_batch_size: 1\n",
            (2, 1),
            "2",
            "--nnodes 2 x --nproc-per-node 2 allows world size(s) 4 ",
        ),
    ],
)
def test_world_without_a_plan_stops_the_launch(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path, config: str, slots: tuple[int, ...],
    nnodes: str, expected: str,
) -> None:  # fmt: skip
    (Path.cwd() / "train.yaml").write_text(config)
    argv = ["-H", _hosts(tmp_path, slots), "--launcher", "fake", "--master-addr", "w0", "--nnodes", nnodes]
    code, err = _run([*argv, "--elastic-config", "train.yaml", "train.py"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"elasticzero-launch: error: {Path.cwd() / 'train.yaml'}: {expected}with no batch plan"), err
    assert "narrow --nnodes or change the batch sizes" in err
    assert launch_env.calls == []


def test_agreeing_plan_launches(launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (Path.cwd() / "train.yaml").write_text(CONFIG)
    argv = ["-H", _hosts(tmp_path, (2, 2)), "--launcher", "fake", "--nnodes", "1:2", "--elastic-config", "train.yaml"]
    code, err = _run([*argv, "train.py"], capsys)
    assert code == 0, err
    assert len(launch_env.calls) == 1


def test_dry_run_checks_too(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    (Path.cwd() / "train.yaml").write_text(CONFIG)
    code, err = _run(["--nproc-per-node", "3", "--elastic-config=train.yaml", "--dry-run", "train.py"], capsys)
    assert code == 2 and "allows world size(s) 3 with no batch plan" in err
    code, err = _run(["--nproc-per-node", "3", "--elastic_config", "missing.yaml", "train.py"], capsys)
    assert code == 2 and "missing.yaml: cannot read config" in err
    assert launch_env.calls == []
