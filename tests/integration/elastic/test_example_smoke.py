"""The README job, short: the smoke ``tests/torch_range.sh`` runs on every supported torch (and the suite on the pinned
one). ``elasticzero-launch`` starts ``examples/train_gpt.py`` on 2 local ranks at ZeRO-2, which train 2 steps and
checkpoint; a second launch on 1 rank at ZeRO-3 resumes from that checkpoint (a reshard 2 → 1 ranks and stage
2 → 3) and trains one step more. Real launcher, agent, rendezvous, engine and DCP checkpoint; a tiny model."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from ez_testing import REPO, free_port

LAUNCH = str(Path(sys.executable).parent / "elasticzero-launch")
EXAMPLE = str(REPO / "examples" / "train_gpt.py")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def _launch(tmp: Path, nproc: int, *flags: str) -> str:
    """One ``elasticzero-launch --nproc-per-node nproc`` of the example (tiny model, small corpus); rank 0's output."""
    job = f"ezt-smoke-{secrets.token_hex(4)}"
    argv = [LAUNCH, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--rdzv-id", job, EXAMPLE]
    argv += ["--size", "tiny", "--seq-len", "32", "--corpus-bytes", "65536", "--cache-dir", str(tmp / "corpus")]
    argv += ["--checkpoint-dir", str(tmp / "ckpt"), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=240, check=False)
    except subprocess.TimeoutExpired:
        kill = [sys.executable, "-m", "elasticzero.agent.cli", "--kill-job", job, "--grace", "2"]
        subprocess.run(kill, capture_output=True, timeout=60, check=False)
        raise
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_two_ranks_save_one_rank_resumes_at_another_stage(tmp_path: Path) -> None:
    first = _launch(tmp_path, 2, "--zero", "2", "--steps", "2", "--save-every", "2")
    assert "world=2 zero=2" in first and "resumed at step 0" in first, first
    assert "step     2/2" in first, first
    second = _launch(tmp_path, 1, "--zero", "3", "--steps", "3")
    assert "world=1 zero=3" in second and "resumed at step 2" in second, second
    assert "step     3/3" in second, second
