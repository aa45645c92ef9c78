"""Ring reduce-scatter / all-gather (engine/zero/ring.py) on real gloo ranks: equal to gloo's own collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ez_testing import free_port

WORKER = Path(__file__).with_name("ring_worker.py")


def _run(world: int, out: Path) -> list[dict[str, Any]]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out)],
            env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(world)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-3000:]}"
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matches_gloo(world: int, tmp_path: Path) -> None:
    for r, res in enumerate(_run(world, tmp_path / "ring")):
        assert res.pop("used_ring") is True, (r, res)
        assert res.pop("unsettled") == 0, (r, res)
        assert all(res.values()), (r, {k: v for k, v in res.items() if not v})
