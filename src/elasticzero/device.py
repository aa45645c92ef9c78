"""Which device a worker computes on and which process-group backend it uses: the one rule for every example.

::

    device = elasticzero.init_distributed()   # cuda:$LOCAL_RANK over NCCL on a GPU node, cpu over gloo elsewhere
    model = GPT(...).to(device)

:func:`placement` is the decision, pure over a snapshot of facts (:class:`Facts`: whether CUDA is available, how many
devices this process sees, the launcher's environment); :func:`init_distributed` is the thin I/O around it
(``torch.cuda.set_device``, ``init_process_group``). The launchers (``elasticzero-run``, ``torchrun``) set
``CUDA_VISIBLE_DEVICES`` to the node's slots and ``LOCAL_RANK`` to the worker's index among them, so ``LOCAL_RANK``
is the CUDA device index. Without ``RANK`` (the script run directly) the world is one process over a ``HashStore``.

The process group's timeout (how long a collective may wait for its peers before it fails) is, in this order: the
``timeout`` argument of :func:`init_distributed`; ``ELASTICZERO_COLLECTIVE_TIMEOUT`` (seconds; ``elasticzero-run``
exports it from ``--collective-timeout``, docs/agent.md); else torch's default (30 min for gloo, 10 min for NCCL).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from elasticzero.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["COLLECTIVE_TIMEOUT_ENV", "Facts", "Placement", "collective_timeout", "init_distributed", "placement"]

#: seconds a collective may wait for its peers (the process group's ``timeout``); set by elasticzero-run
COLLECTIVE_TIMEOUT_ENV = "ELASTICZERO_COLLECTIVE_TIMEOUT"


@dataclass(frozen=True)
class Facts:
    """What the decision reads: ``torch.cuda.is_available()``, ``torch.cuda.device_count()`` and the environment."""

    cuda_available: bool
    device_count: int
    env: Mapping[str, str]

    @classmethod
    def current(cls, env: Mapping[str, str] | None = None) -> Facts:
        """This process's facts; ``env``: the environment to read (default ``os.environ``)."""
        import torch

        available = torch.cuda.is_available()
        return cls(available, torch.cuda.device_count() if available else 0, dict(os.environ if env is None else env))


@dataclass(frozen=True)
class Placement:
    """Where a worker runs: ``device`` (``"cpu"`` or ``"cuda:N"``), the backend, and whether it is alone (no
    launcher: a world of one over an in-process store)."""

    device: str
    backend: str
    alone: bool
    timeout: timedelta | None = None  #: the process group's timeout; None: torch's default for the backend

    @property
    def bound_device(self) -> str | None:
        """The device the process group is bound to (``init_process_group(device_id=...)``): the CUDA device under
        NCCL, so the communicator is created eagerly on it and no collective or barrier guesses a device; none on
        the CPU."""
        return self.device if self.backend == "nccl" else None


def placement(facts: Facts) -> Placement:
    """``cuda:$LOCAL_RANK`` over NCCL when CUDA is available, else ``cpu`` over gloo; a ``LOCAL_RANK`` that names no
    visible device is a :class:`UsageError` (before any process group exists)."""
    alone = "RANK" not in facts.env
    timeout = collective_timeout(facts.env)
    if not facts.cuda_available or facts.device_count < 1:
        return Placement("cpu", "gloo", alone, timeout)
    return Placement(f"cuda:{_local_rank(facts)}", "nccl", alone, timeout)


def collective_timeout(env: Mapping[str, str]) -> timedelta | None:
    """``ELASTICZERO_COLLECTIVE_TIMEOUT`` as a timeout (None when unset); not a positive number: :class:`UsageError`."""
    raw = env.get(COLLECTIVE_TIMEOUT_ENV)
    if raw is None:
        return None
    return timedelta(seconds=parse_seconds(raw, f"{COLLECTIVE_TIMEOUT_ENV}={raw!r}"))


def parse_seconds(text: str, what: str) -> float:
    """A positive, finite number of seconds from ``text``; otherwise a :class:`UsageError` naming ``what``."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"{what}: give a positive number of seconds, e.g. 300")
    return seconds


def _local_rank(facts: Facts) -> int:
    raw = facts.env.get("LOCAL_RANK", "0")
    if not (raw.isascii() and raw.isdigit()):
        raise UsageError(f"LOCAL_RANK={raw!r} is not a device index; start workers with elasticzero-launch or torchrun")
    if int(raw) >= facts.device_count:
        visible = facts.env.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise UsageError(
            f"LOCAL_RANK={raw} but this process sees {facts.device_count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={visible}): start at most {facts.device_count} workers per node"
        )
    return int(raw)


def init_distributed(facts: Facts | None = None, *, timeout: timedelta | None = None) -> torch.device:
    """Select this worker's device (:func:`placement`) and initialise the default process group on it; returns the
    device. NCCL binds the group to it (``device_id``), so its first collective needs no device guess. ``timeout``
    (given) wins over the launcher's ``ELASTICZERO_COLLECTIVE_TIMEOUT``; neither: torch's default."""
    import torch
    import torch.distributed as dist

    where = placement(facts or Facts.current())
    device = torch.device(where.device)
    if where.bound_device is not None:
        torch.cuda.set_device(device)
    bound = torch.device(where.bound_device) if where.bound_device is not None else None
    limit = timeout if timeout is not None else where.timeout  # None: torch's default for the backend
    if where.alone:
        dist.init_process_group(
            where.backend, store=dist.HashStore(), rank=0, world_size=1, device_id=bound, timeout=limit
        )
    else:
        dist.init_process_group(where.backend, device_id=bound, timeout=limit)  # the launcher's env:// variables
    return device
