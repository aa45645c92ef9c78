"""The exec shim as the agent starts it (``python -S -c SHIM_STUB ROOT -- CMD…``): no site, package found at ROOT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import elasticzero
from elasticzero.agent.binding import AGENT_PID_ENV, shim_argv


def test_shim_runs_without_site_and_execs_the_command(tmp_path: Path) -> None:
    root = str(Path(elasticzero.__file__).resolve().parent.parent)
    out = tmp_path / "out"
    script = 'printf "%s|%s" "$1" "$LOCAL_SIZE" > "$2"'
    exe, args = shim_argv(sys.executable, "/bin/sh", ["-c", script, "sh", "a;b $(c)", str(out)], root)
    env = {"PATH": "/usr/bin:/bin", "LOCAL_WORLD_SIZE": "2", AGENT_PID_ENV: str(os.getpid())}
    proc = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "a;b $(c)|2"  # argv byte-exact; DeepSpeed's LOCAL_SIZE added by the shim
