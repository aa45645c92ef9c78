"""The launcher keeps its nodes (``--max-node-restarts N``): pure decisions over what the node commands did.

With a backend that starts one command per node (pdsh under supervision: ``pdsh -w HOST`` per host), the
launcher watches each node's command. When one ends, :func:`on_exit` decides, from a snapshot of the job
(:class:`JobView`), whether that node is started again and when — the I/O (stopping what is left of the job on that
host, staging its environment again, starting the command) is ``execute``'s and the backend's.

The rules:

* an ending is a **node loss** when the transport reports the host gone or the agent killed: ssh's 255 (the
  connection died, the host is unreachable or rebooted) or 128+N (the remote agent died of signal N: SIGKILL, the
  OOM killer, a shutdown's SIGTERM). Any other code is the **job's result**: 0 (the job finished) or the agent's
  failure code (the workers failed beyond ``--max-restarts``), which no restart can change;
* a node loss is restarted while the job runs — no node has reported the job's result yet and another node's
  command is still running (a job whose every node is gone has nothing left to rejoin) — and while the budget lasts:
  ``--max-node-restarts`` node restarts over the whole job;
* restarts back off: 1 s before a node's first, doubling per further restart of that node, at most 30 s;
* the launch's exit code (:func:`job_exit`): the first job failure among the nodes' last endings; else 0 when some
  node finished the job; else the first node loss's code (the job lost every node).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from elasticzero.proc import exit_signal

#: ssh's exit code when the connection failed or died
SSH_LOST = 255
#: backoff before a node's first restart, doubled per further restart of that node, capped
BACKOFF_S, BACKOFF_CAP_S = 1.0, 30.0


def backoff(node_restarts: int) -> float:
    """Seconds before a node's next try, after ``node_restarts`` restarts (or failed tries) of that node."""
    return min(BACKOFF_CAP_S, BACKOFF_S * 2**node_restarts)


def is_node_loss(code: int) -> bool:
    """Whether a node command's exit ``code`` says the node was lost (ssh 255, or the agent killed by a signal)."""
    return code == SSH_LOST or exit_signal(code) is not None


def describe(code: int) -> str:
    """``code`` in words, for the restart line."""
    if code == SSH_LOST:
        return "exit 255: the ssh connection failed or died"
    sig = exit_signal(code)
    if sig is None:
        return f"exit {code}"
    try:
        return f"exit {code}: the agent was killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"exit {code}: the agent was killed by signal {sig}"


@dataclass(frozen=True)
class JobView:
    """What the decision needs of the job when a node command ends."""

    others_running: int  # node commands still running, the ended one not counted
    result_seen: bool  # some node's command ended with the job's result (0 or a job failure)
    restarts_used: int  # node restarts spent so far, over the whole job
    budget: int  # --max-node-restarts
    node_restarts: int  # restarts of this node so far


@dataclass(frozen=True)
class Restart:
    """Start the node's command again after ``delay_s``; ``line`` says so."""

    delay_s: float
    line: str


@dataclass(frozen=True)
class Keep:
    """The ending stands; ``line`` (may be empty) says why the node is not restarted."""

    line: str


def on_exit(host: str, code: int, job: JobView) -> Restart | Keep:
    """What to do when ``host``'s command ended with ``code`` (see the module's rules)."""
    if not is_node_loss(code):
        return Keep("")
    what = f"{host}'s agent ended ({describe(code)})"
    if job.result_seen or job.others_running == 0:
        return Keep(f"{what}; the job is over on the other nodes: not restarted")
    if job.restarts_used >= job.budget:
        return Keep(f"{what}; no node restarts left (--max-node-restarts {job.budget}): the job goes on without it")
    delay = backoff(job.node_restarts)
    n = job.restarts_used + 1
    return Restart(delay, f"{what}; starting it again in {delay:.0f} s (node restart {n} of {job.budget})")


def job_exit(last_codes: Sequence[int]) -> int:
    """The launch's exit code from each node's last ending, in the order they ended (see the module's rules)."""
    failures = [c for c in last_codes if c != 0 and not is_node_loss(c)]
    if failures:
        return failures[0]
    if 0 in last_codes:
        return 0
    return last_codes[0] if last_codes else 0
