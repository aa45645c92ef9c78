"""How long the workers' collectives may hang: the process-group timeout and torch's NCCL error handling.

:func:`collective_plan` is a pure decision over ``--collective-timeout`` and the agent's environment; the result is
part of the :class:`~elasticzero.agent.plan.AgentPlan` and goes into every worker's environment. The worker side reads
:data:`~elasticzero.device.COLLECTIVE_TIMEOUT_ENV` in :func:`elasticzero.device.init_distributed` (the one rule) and
passes it as ``init_process_group(timeout=...)``. The choices and the default are explained in docs/agent.md
("Collective timeouts").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from elasticzero.device import COLLECTIVE_TIMEOUT_ENV, parse_seconds

#: seconds; far below torch's 30 min (gloo) / 10 min (NCCL), above legitimate slow collectives (docs/agent.md)
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
#: torch's NCCL knobs the agent sets unless the user's environment already does (under the name or its alias)
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
HEARTBEAT_TIMEOUT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
#: torch's older spellings of the first two (torch still reads them)
_ALIASES = {ASYNC_ERROR_HANDLING: "NCCL_ASYNC_ERROR_HANDLING", BLOCKING_WAIT: "NCCL_BLOCKING_WAIT"}
#: 3 = SkipCleanUp: on a timeout the watchdog ends the process without ncclCommAbort (which can itself hang);
#: the agent sees a failed worker. 0 = the process stays alive, blocked; the hang would outlast the bound.
ASYNC_ERROR_HANDLING_VALUE = "3"
#: 0: the watchdog thread enforces the timeout; 1 would make every ``wait()`` a host-side busy poll
BLOCKING_WAIT_VALUE = "0"
#: the heartbeat monitor (the watchdog's own backstop) never waits less than this, so a busy host's slow watchdog
#: loop does not kill healthy workers when the collective timeout is small
MIN_HEARTBEAT_S = 60


@dataclass(frozen=True)
class CollectivePlan:
    """The workers' collective timeout and the variables that carry it and torch's NCCL error handling."""

    timeout_s: float  #: what the workers' ``init_process_group(timeout=)`` gets
    source: str  #: ``--collective-timeout``, the user's environment, or ``default``
    env: Mapping[str, str]  #: added to every worker's environment


def collective_plan(flag: str | None, environ: Mapping[str, str]) -> CollectivePlan:
    """The flag, else the user's ``ELASTICZERO_COLLECTIVE_TIMEOUT``, else :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`; and the
    NCCL knobs, each only where the user's environment does not set it."""
    timeout_s, source = _timeout(flag, environ)
    env = {COLLECTIVE_TIMEOUT_ENV: _seconds_text(timeout_s)}
    wanted = {
        ASYNC_ERROR_HANDLING: ASYNC_ERROR_HANDLING_VALUE,
        BLOCKING_WAIT: BLOCKING_WAIT_VALUE,
        HEARTBEAT_TIMEOUT: str(max(MIN_HEARTBEAT_S, math.ceil(timeout_s))),
    }
    env.update({name: value for name, value in wanted.items() if not _user_sets(name, environ)})
    return CollectivePlan(timeout_s, source, env)


def _timeout(flag: str | None, environ: Mapping[str, str]) -> tuple[float, str]:
    if flag is not None:
        return parse_seconds(flag, f"--collective-timeout {flag}"), "--collective-timeout"
    raw = environ.get(COLLECTIVE_TIMEOUT_ENV)
    if raw is not None:
        return parse_seconds(raw, f"{COLLECTIVE_TIMEOUT_ENV}={raw!r}"), COLLECTIVE_TIMEOUT_ENV
    return DEFAULT_COLLECTIVE_TIMEOUT_S, "default"


def _user_sets(name: str, environ: Mapping[str, str]) -> bool:
    return name in environ or _ALIASES.get(name, name) in environ


def _seconds_text(seconds: float) -> str:
    """``300`` rather than ``300.0`` (what a user would write); fractions kept."""
    return str(int(seconds)) if seconds == int(seconds) else repr(seconds)
