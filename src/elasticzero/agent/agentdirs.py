"""Per-agent scratch folders on the node: one rule for their names, and the sweep of those a dead agent left.

An agent keeps its workers' progress records (``progress``), under ``--live-recovery`` its round file (``round``)
and, without ``--log-dir``, its workers' logs and error files (``logs``; torch's default there is a
``torchelastic_*`` folder that nothing ever removes) in ``$TMPDIR/elasticzero-<kind>-<job id>-<agent pid>`` (else
``/tmp``), each made for its user alone (:func:`make_private`: 0700; a link or another user's folder at the path is
refused — the agent empties and writes them), and removes them when it ends — the logs folder only where it holds no
file (:func:`remove_if_empty`: what a worker wrote, a failure's error file, stays for the user). A SIGKILLed agent
cannot: :func:`stale` picks, among a folder listing, the ones of a job whose agent is no longer running (pure),
:func:`sweep` removes them — run by ``elasticzero-run --kill-job`` after it stopped the job's processes, and by every
agent when it starts (a node's agent killed earlier in the same job).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping

from elasticzero.errors import UsageError

KINDS = ("progress", "round", "logs")
KEPT_IF_WRITTEN = ("logs",)  #: kinds removed only where they hold no file


def scratch_root(environ: Mapping[str, str]) -> str:
    """Where agents keep their folders: ``$TMPDIR``, else ``/tmp``."""
    return environ.get("TMPDIR") or "/tmp"


def _head(kind: str) -> str:
    """The start of the names of ``kind``'s folders (the job's id, a dash and the agent's pid follow)."""
    return f"elasticzero-{kind}-"


def agent_dir(environ: Mapping[str, str], kind: str, job_id: str, agent_pid: int) -> str:
    """The folder of ``kind`` of the agent ``agent_pid`` of job ``job_id``."""
    return os.path.join(scratch_root(environ), f"{_head(kind)}{job_id}-{agent_pid}")


def make_private(path: str, fix: str = "remove it") -> None:
    """Create the agent's folder ``path`` for its user alone (0700: logs can hold what a job prints), or take the one
    this user made there earlier (the same agent running again as a new node); anything else at ``path`` — another
    user's folder, a link (the agent empties and writes its folders: a link would have it do so elsewhere) — is
    refused, the error ending with ``fix``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # the scratch root ($TMPDIR): the user's
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise UsageError(f"{path} exists and is not a folder of this user's: {fix}") from None


def stale(names: Iterable[str], job_id: str, alive: Callable[[int], bool]) -> list[str]:
    """The names among ``names`` that are folders of ``job_id``'s agents no longer ``alive``."""
    out = []
    for name in names:
        for kind in KINDS:
            head = f"{_head(kind)}{job_id}-"
            pid = name[len(head) :] if name.startswith(head) else ""
            if pid.isdigit() and not alive(int(pid)):
                out.append(name)
    return sorted(out)


def sweep(environ: Mapping[str, str], job_id: str, alive: Callable[[int], bool] | None = None) -> int:
    """Remove the folders :func:`stale` finds under the scratch root (a logs folder only where it holds no file);
    returns how many are gone."""
    root = scratch_root(environ)
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    return sum(_remove(os.path.join(root, name)) for name in stale(names, job_id, alive or _running))


def _remove(path: str) -> bool:
    """Remove an agent's folder as its kind says (:data:`KEPT_IF_WRITTEN`); returns whether it is gone."""
    if os.path.basename(path).startswith(tuple(_head(kind) for kind in KEPT_IF_WRITTEN)):
        return remove_if_empty(path)
    shutil.rmtree(path, ignore_errors=True)
    return True


def remove_if_empty(path: str) -> bool:
    """Remove the folder ``path`` if no file lies anywhere under it (its empty subfolders go with it); returns whether
    it is gone. A folder with a file is left whole."""
    for _, _, files in os.walk(path):
        if files:
            return False
    for sub, _, _ in os.walk(path, topdown=False):  # the subfolders before the folder that holds them
        try:
            os.rmdir(sub)
        except OSError:  # written meanwhile, or gone: left as it is
            return False
    return not os.path.exists(path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
