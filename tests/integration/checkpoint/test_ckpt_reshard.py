"""Reshard on load (checkpoint/, engine/zero/dcp_state.py), one world-3 launch for every case: stages 1/2/3 x
fp32/bf16 x N→M in {2→1, 1→2, 2→3, 3→2}, stage changes 2→3, 3→1 (also 2→3 at one world size,
3→1 at 2 ranks, fp16 2→3 at 2→3 ranks).
fp32 masters and Adam moments are bit-exact after the load; training resumed from it ends where the uninterrupted
run ends (bitwise at the same world size and stage, else up to reduction order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_reshard_matrix(tmp_path: Path) -> None:
    out = tmp_path / "reshard"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, str(HERE / "reshard_worker.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(3)]
    assert len(results[0]) == 29
    for r, res in enumerate(results):
        failed = {case: problems for case, problems in res.items() if problems}
        assert not failed, f"rank {r}: {failed}"
