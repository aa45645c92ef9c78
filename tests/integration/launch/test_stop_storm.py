"""A clean stop under a storm of stop signals: ``elasticzero-launch --launcher local`` (the launcher becomes the
agent) gets SIGTERM, then SIGHUP, SIGINT, SIGTERM, SIGQUIT every 20 ms until it exits.

That is what a job's stop looks like from a node: the launcher's SIGTERM, pdsh's remote clean-up, the ssh session's
SIGHUP. Before ``agent/stopsignals.py`` each later signal was raised again by torch's handler wherever the agent
was — inside its worker shutdown (workers left behind), in logging ("--- Logging error ---" with a traceback), in a
finalizer ("Exception ignored in …") — and one arriving after Python reset its handlers killed the agent at the
default action (exit -3 for SIGQUIT). Workers are ``sleep`` (no torch import): one interpreter in all.
"""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launchkit import job_pids, kill_job, wait_for, worker_env_clean

from ez_testing import free_port

LAUNCH = str(Path(sys.executable).parent / "elasticzero-launch")
STORM = [signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT]
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def _sleepers(job: str) -> list[int]:
    return [p for p in job_pids(job) if psutil.Process(p).name() == "sleep"]


def test_a_storm_of_stop_signals_stops_everything_once_without_a_traceback(tmp_path: Path) -> None:
    job = f"ezt-storm-{secrets.token_hex(4)}"
    argv = [LAUNCH, "--launcher", "local", "--nproc-per-node", "2", "--rdzv-id", job, "--master-port", str(free_port())]
    argv += ["--no-python", "sleep", "600"]
    proc = subprocess.Popen(argv, env=worker_env_clean(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(_sleepers(job)) == 2 or proc.poll() is not None, 120, "two running workers")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        sent = 1
        while proc.poll() is None and sent < 2000:
            time.sleep(0.02)
            try:
                proc.send_signal(STORM[sent % len(STORM)])
            except ProcessLookupError:
                break
            sent += 1
        stderr = proc.communicate(timeout=60)[1]
        wait_for(lambda: not job_pids(job), 30, "no process of the job left")
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_job(job)
    stops = re.findall(r"^elasticzero-run: stopped by (SIG[A-Z]+)$", stderr, re.M)
    assert len(stops) == 1, stderr[-3000:]  # one stop, by the first signal the agent took
    assert proc.returncode == 128 + signal.Signals[stops[0]], (proc.returncode, stderr[-3000:])
    for trace in ("Traceback", "Exception ignored", "Logging error"):
        assert trace not in stderr, stderr[-3000:]
    assert sent > 1  # the storm met the agent (it takes seconds to stop its workers and leave)
