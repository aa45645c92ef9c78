"""Checkpoint faults on real gloo ranks (one driver process forks every world, see ckpt_fork.py): a torn async save,
damaged or foreign checkpoints (one UsageError on every rank, nothing loaded), SIGKILL of a rank at each phase of
the commit protocol (the newest committed checkpoint always loads), and the elasticzero-checkpoint CLI on what those
runs left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticzero.checkpoint import cli

HERE = Path(__file__).parent
# phase of the commit protocol, killed rank, the step that must load afterwards
KILLS = [("snapshot", 1, 2), ("written", 1, 2), ("manifest", 0, 2), ("committed", 0, 4), ("published", 0, 4)]


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("faults") / "f"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    argv = [sys.executable, str(HERE / "faults_worker.py"), str(out), *[f"{p}:{v}" for p, v, _ in KILLS]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, json.loads(Path(f"{out}.summary").read_text())


def test_async_save_is_not_torn(faults: tuple[Path, dict[str, Any]]) -> None:
    for res in faults[1]["faults"]:
        assert res["torn"] == []


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("truncated", "__1_0.distcp: 15"),
        ("flipped", "checksum (xxh3_64) differs"),
        ("shard_missing", "__1_0.distcp: missing"),
        ("format", "unknown checkpoint format 99"),
        ("evil_metadata", "refusing to import posix.system"),
        ("other_model", "'zero.params.emb.weight' has shape (66,) in the checkpoint, (88,) here"),
    ],
)
def test_bad_checkpoint_is_one_error_and_touches_nothing(
    faults: tuple[Path, dict[str, Any]], case: str, needle: str
) -> None:
    out, summary = faults
    for res in summary["faults"]:
        assert res[case].startswith(f"UsageError: {out}.d/{case}"), res[case]
        assert needle in res[case], res[case]
        assert "CHANGED" not in res[case], res[case]
        assert res["pwned"] == "False"


def test_cli_inspect_verify_consolidate(
    faults: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(f"{faults[0]}.d")
    assert cli.main(["inspect", str(root / "good")]) == 0
    shown = capsys.readouterr().out
    assert "step 2: world size 2" in shown and "latest: 2" in shown, shown
    assert "layout.stage=3" in shown and "layout.precision=bfloat16" in shown and "seen=12" in shown, shown
    assert cli.main(["inspect", "--json", str(root / "good")]) == 0
    assert json.loads(capsys.readouterr().out)["latest"] == 2
    assert cli.main(["verify", str(root / "good")]) == 0
    assert cli.main(["verify", "--step", "2", str(root / "flipped")]) == 1
    assert "checksum (xxh3_64) differs" in capsys.readouterr().out
    out = tmp_path / "model.pt"
    assert cli.main(["consolidate", str(root / "good"), str(out)]) == 0
    got, want = torch.load(out, weights_only=True), torch.load(root / "good_full.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert cli.main(["consolidate", str(root / "truncated"), str(tmp_path / "x.pt")]) == 2
    assert "truncated or replaced" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize(("phase", "victim", "step"), KILLS)
def test_kill_during_save_keeps_the_newest_committed(
    faults: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str], phase: str, victim: int, step: int
) -> None:
    out, summary = faults
    kout = f"{out}.kill_{phase}"
    assert summary[f"killed_{phase}"] is True
    assert summary["load"][kout] == {"step": step, "mismatches": []}
    assert cli.main(["verify", f"{kout}.d"]) == 0
    assert cli.main(["inspect", f"{kout}.d"]) == 0
    if phase in ("written", "manifest"):
        assert "ignored: step-00000004.tmp-" in capsys.readouterr().out


def test_cli_bad_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["verify", str(tmp_path / "nope")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert cli.main(["consolidate", str(tmp_path), str(tmp_path / "o.pt")]) == 2
    assert "no committed step" in capsys.readouterr().err
