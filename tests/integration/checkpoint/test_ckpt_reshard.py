"""Reshard on load (checkpoint/, engine/zero/dcp_state.py), one world-3 launch for every case: stages 1/2/3 x
fp32/bf16 x N→M in {2→1, 1→2, 2→3, 3→2}, stage changes 2→3, 3→1 (also 2→3 at one world size,
3→1 at 2 ranks, fp16 2→3 at 2→3 ranks).
fp32 masters and Adam moments are bit-exact after the load; training resumed from it ends where the uninterrupted
run ends, up to reduction order: off a float64 run from the saved state by at most what rounding moved the
uninterrupted run (``ez_numerics``)."""

from __future__ import annotations

from pathlib import Path

from ckpt_fork import drive

HERE = Path(__file__).parent


def test_reshard_matrix(tmp_path: Path) -> None:
    out = tmp_path / "reshard"
    drive(HERE / "reshard_worker.py", out, cases=29, timeout=400)
