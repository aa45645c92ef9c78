"""Per-agent scratch folders on the node: one rule for their names, and the sweep of those a dead agent left.

An agent keeps its workers' progress records (``progress``) and, under ``--live-recovery``, its round file
(``round``) in ``$TMPDIR/elasticzero-<kind>-<job id>-<agent pid>`` (else ``/tmp``), and removes them when it ends. A
SIGKILLed agent cannot: :func:`stale` picks, among a folder listing, the ones of a job whose agent is no longer
running (pure), :func:`sweep` removes them — run by ``elasticzero-run --kill-job`` after it stopped the job's
processes, and by every agent when it starts (a node's agent killed earlier in the same job).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping

KINDS = ("progress", "round")


def scratch_root(environ: Mapping[str, str]) -> str:
    """Where agents keep their folders: ``$TMPDIR``, else ``/tmp``."""
    return environ.get("TMPDIR") or "/tmp"


def agent_dir(environ: Mapping[str, str], kind: str, job_id: str, agent_pid: int) -> str:
    """The folder of ``kind`` of the agent ``agent_pid`` of job ``job_id``."""
    return os.path.join(scratch_root(environ), f"elasticzero-{kind}-{job_id}-{agent_pid}")


def stale(names: Iterable[str], job_id: str, alive: Callable[[int], bool]) -> list[str]:
    """The names among ``names`` that are folders of ``job_id``'s agents no longer ``alive``."""
    out = []
    for name in names:
        for kind in KINDS:
            head = f"elasticzero-{kind}-{job_id}-"
            pid = name[len(head) :] if name.startswith(head) else ""
            if pid.isdigit() and not alive(int(pid)):
                out.append(name)
    return sorted(out)


def sweep(environ: Mapping[str, str], job_id: str, alive: Callable[[int], bool] | None = None) -> int:
    """Remove the folders :func:`stale` finds under the scratch root; returns how many."""
    root = scratch_root(environ)
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    gone = stale(names, job_id, alive or _running)
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return len(gone)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
