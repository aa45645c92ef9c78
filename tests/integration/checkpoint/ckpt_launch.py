"""Launch checkpoint workers as real gloo ranks (one process each) and collect their JSON results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ez_testing import free_port

HERE = Path(__file__).parent


def start(worker: str, world: int, args: Sequence[str], extra_env: dict[str, str] | None = None) -> list[Any]:
    port = str(free_port())
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env.update(extra_env or {})
    return [
        subprocess.Popen(
            [sys.executable, str(HERE / worker), *args],
            env=dict(env, RANK=str(r)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def finish(procs: list[Any], timeout: float = 200) -> list[str]:
    """Wait for every rank; returns their stderr; fails on a non-zero exit."""
    errs = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-4000:]}"
        errs.append(err)
    return errs


def run(worker: str, world: int, out: Path, *args: str) -> list[dict[str, Any]]:
    finish(start(worker, world, [str(out), *args]))
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
