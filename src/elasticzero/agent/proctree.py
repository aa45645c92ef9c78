"""Process-tree utilities (psutil): find, signal and reap whole trees, scoped by pid or by job id.

Never matches processes by command line: a tree is either the descendants of pids we started, or the processes
whose environment carries our ``ELASTICZERO_JOB_ID`` / ``ELASTICZERO_AGENT_PID`` value.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import psutil


def descendants(pids: Iterable[int]) -> list[psutil.Process]:
    """The given processes and all their descendants that exist now (children before their parents are fine)."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found[proc.pid] = proc
            for child in proc.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            continue
    return list(found.values())


def processes_with_env(name: str, value: str, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """Processes whose environment has ``name=value`` (those we may not read are skipped)."""
    skip = set(exclude)
    out: list[psutil.Process] = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            if proc.environ().get(name) == value:
                out.append(proc)
        except (psutil.Error, OSError):
            continue
    return out


def own_lineage() -> set[int]:
    """This process and its ancestors (never signal the shell or ssh session that runs us)."""
    pids = {os.getpid()}
    try:
        pids |= {p.pid for p in psutil.Process().parents()}
    except psutil.Error:
        pass
    return pids


def signal_all(procs: Iterable[psutil.Process], sig: int) -> None:
    """Send ``sig`` to each process, ignoring ones that already exited."""
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            continue


def terminate_trees(procs: Iterable[psutil.Process], grace: float, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """SIGTERM every process (and the descendants they have now), SIGKILL what is left after ``grace`` seconds.

    Pids in ``exclude`` are never signalled. Returns the processes that were signalled.
    """
    skip = set(exclude)
    targets = [p for p in descendants(p.pid for p in procs) if p.pid not in skip]
    if not targets:
        return []
    signal_all(targets, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(targets, timeout=max(grace, 0.0))
    if alive:
        signal_all(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    return targets


def kill_now(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL every process immediately and wait briefly for them to go."""
    procs = list(procs)
    signal_all(procs, signal.SIGKILL)
    psutil.wait_procs(procs, timeout=5)


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive (zombies count as gone); return the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout
    pending = list(pids)
    while True:
        pending = [p for p in pending if _alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
