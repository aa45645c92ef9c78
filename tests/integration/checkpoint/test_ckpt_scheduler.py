"""The learning-rate schedule is in the checkpoint and resumes at another world size: saved at world 2, loaded at
world 1, the steps after the load run at the learning rates of the uninterrupted world-2 run, which are DeepSpeed's
own (``tests/unit/config/data/deepspeed_lr_schedules.json``, the same ``WarmupDecayLR`` parameters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
FIXTURE = HERE.parents[1] / "unit" / "config" / "data" / "deepspeed_lr_schedules.json"


def test_schedule_saved_at_world_2_resumes_at_world_1(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from scheduler_worker import SCHEDULE

    case = next(c for c in json.loads(FIXTURE.read_text())["cases"] if c["name"] == "decay_log")
    assert {"type": case["type"], "params": case["params"]} == SCHEDULE and case["lr"] != case["lrs"][0][0]
    out = tmp_path / "sched"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run([sys.executable, str(HERE / "scheduler_worker.py"), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(Path(f"{out}.summary").read_text())
    deepspeed = [lrs[0] for lrs in case["lrs"][:6]]
    assert summary["world2"] == [deepspeed, deepspeed]  # both ranks
    assert summary["world1"] == [deepspeed[3:]]
