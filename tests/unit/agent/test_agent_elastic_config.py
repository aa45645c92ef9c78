"""``elasticzero-run --elastic-config FILE``: ``--nnodes MIN:MAX`` x ``--nproc-per-node`` allowing a world size with
no batch plan is one error line and exit 2 before the agent starts; an agreeing range goes on to launch (stubbed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import elasticzero.agent.launch
from elasticzero.agent.cli import main

CONFIG = "train_batch_size: 16\nmicro_batch_size: 4\n"  # valid world sizes 1, 2, 4


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """``launch`` replaced by a recorder (nothing starts); the agent's env changes stay in a copy of ``os.environ``."""
    calls: list[tuple[Any, ...]] = []

    def launch(*args: Any, **kwargs: Any) -> tuple[None, None]:
        calls.append(args)
        return None, None

    monkeypatch.setattr(elasticzero.agent.launch, "launch", launch)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    return calls


def _argv(config: Path, nnodes: str, nproc: str) -> list[str]:
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "ezcfg"]
    return ["--nnodes", nnodes, "--nproc-per-node", nproc, *rdzv, "--elastic-config", str(config), "train.py"]


@pytest.mark.parametrize(("nnodes", "nproc", "bad"), [("1:3", "2", "6"), ("3", "1", "3"), ("1:4", "1", "3")])
def test_world_without_a_plan_is_refused_before_start(
    launched: list[tuple[Any, ...]], capsys: pytest.CaptureFixture[str], tmp_path: Path, nnodes: str, nproc: str,
    bad: str,
) -> None:  # fmt: skip
    config = tmp_path / "train.yaml"
    config.write_text(CONFIG)
    assert main(_argv(config, nnodes, nproc)) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"elasticzero-run: error: {config}: --nnodes {nnodes} x ")
    assert f"--nproc-per-node {nproc} allows world size(s) {bad} with no batch plan for global batch 16" in err
    assert launched == []


def test_agreeing_range_launches(launched: list[tuple[Any, ...]], tmp_path: Path) -> None:
    config = tmp_path / "train.yaml"
    config.write_text(CONFIG)
    assert main(_argv(config, "1:2", "2")) == 0
    assert len(launched) == 1


def test_unreadable_config_is_refused(launched: list[tuple[Any, ...]], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(Path("no-such.yaml"), "1:2", "1")) == 2
    assert "no-such.yaml: cannot read config" in capsys.readouterr().err
    assert launched == []
