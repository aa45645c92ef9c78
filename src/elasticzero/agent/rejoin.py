"""An agent cut off from its rendezvous stays and joins again (pure decisions, no I/O).

A node whose rendezvous store stops answering cannot tell "the store's host froze" from "I am cut off": c10d's store
lives in one agent (that node froze or is cut off, or this one is), etcd's outside the job (this node is cut off,
or etcd is down). Either way this node's workers are stopped (:mod:`~elasticzero.agent.tick`'s ``Stop``; a stale
worker's checkpoint write is refused by the directory's fence). Exiting then turned every network blip on a node
into a permanent loss: the link came back, nothing rejoined. So the agent stays: it tries the rendezvous again,
as a new node (a fresh handler, a fresh store client), for a bounded time — ``--rejoin-timeout``, by default the
rendezvous's join timeout — and when the store answers it joins the running job (with ``--live-recovery`` its
fresh workers join live). It exits when that time runs out, or when the rendezvous is closed (the job is over).

:func:`rejoin_plan` decides the budget from the command line; :func:`next_try` what to do after a try that could
not reach the store; the lines say what the agent does and for how long. The I/O is ``agent/cli.py``'s loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticzero.agent.options import whole_seconds

#: torch's ``DynamicRendezvousHandler`` join timeout when nothing sets one
TORCH_JOIN_TIMEOUT_S = 600
#: seconds between two tries that could not reach the store (a try itself waits for the store: c10d's connect
#: waits up to ``read_timeout``, etcd's ``connect_timeout``)
PAUSE_S = 1.0


@dataclass(frozen=True)
class RejoinPlan:
    """How long a node cut off from its rendezvous keeps trying to join it again (0: it exits at once)."""

    timeout_s: int
    source: str  #: ``--rejoin-timeout``, ``join_timeout`` / ``timeout`` (``--rdzv-conf``) or ``default``


#: without a rendezvous config: torch's join timeout
DEFAULT_REJOIN = RejoinPlan(TORCH_JOIN_TIMEOUT_S, "default: the join timeout")


def rejoin_plan(flag: str | None, user_conf: Mapping[str, str]) -> RejoinPlan:
    """``--rejoin-timeout`` (whole seconds >= 0), else the join timeout ``--rdzv-conf`` sets, else torch's."""
    if flag is not None:
        return RejoinPlan(_seconds(flag, "--rejoin-timeout"), "--rejoin-timeout")
    for key in ("join_timeout", "timeout"):  # the elasticzero rendezvous's rule: join_timeout wins over its alias
        if key in user_conf:
            return RejoinPlan(_seconds(user_conf[key], f"--rdzv-conf {key}"), key)
    return DEFAULT_REJOIN


def _seconds(text: str, what: str) -> int:
    return whole_seconds(text, what, zero="0: exit at once when cut off from the rendezvous")


@dataclass(frozen=True)
class Retry:
    """Try the rendezvous again after ``after_s``."""

    after_s: float


@dataclass(frozen=True)
class GiveUp:
    """Stop trying: print ``line``, exit 1."""

    line: str


def next_try(plan: RejoinPlan, elapsed_s: float, error: str) -> Retry | GiveUp:
    """After a try that could not reach the store (``error``), ``elapsed_s`` after the cut: again, or give up."""
    if elapsed_s >= plan.timeout_s:
        return GiveUp(
            f"could not join the rendezvous again within {plan.timeout_s} s of being cut off ({plan.source}; "
            f"--rejoin-timeout): {error}; exiting"
        )
    return Retry(min(PAUSE_S, plan.timeout_s - elapsed_s))


def cut_off_line(cause: str, plan: RejoinPlan) -> str:
    """The one line at the cut: what happened (``cause``), what the agent does and for how long."""
    if plan.timeout_s == 0:
        return f"{cause}; this node stopped its workers and exits (--rejoin-timeout 0)"
    return (
        f"{cause}; this node stopped its workers and tries to join the rendezvous again as a new node for up to "
        f"{plan.timeout_s} s ({plan.source}; --rejoin-timeout)"
    )
