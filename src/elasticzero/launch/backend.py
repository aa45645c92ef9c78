"""The launcher-backend contract and its entry-point registry.

A backend turns a :class:`~elasticzero.launch.plan.LaunchPlan` into the local commands that start one
``elasticzero-run`` agent per node (``pdsh …``, ``mpirun …``, ``srun …``, or the agent itself). Backends are found
through the entry-point group ``elasticzero.launchers``; the ones shipped with elasticzero live in ``plugins/``.

Rules every backend follows:

* commands are argv lists; the only place a string is built for a shell is a remote-shell boundary (pdsh/ssh,
  or an argument a transport pastes into its own ssh string, as MVAPICH's ``mpirun_rsh`` does), and there every
  element goes through :func:`shlex.quote` once;
* environment crosses by *name* where the transport allows it (``mpirun -x NAME``, ``-genvlist``, srun's inherited
  environment), so values are never quoted;
* each node's agent learns which node it is from the plan's node table (see
  :meth:`LaunchPlan.agent_argv`), never from the order a transport happens to pick.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, ClassVar

from elasticzero.errors import UsageError

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan

ENTRY_POINT_GROUP = "elasticzero.launchers"


@dataclass(frozen=True)
class Command:
    """One local process the launcher starts.

    ``env`` holds variables to add to the launcher's own environment for this process (for transports that
    forward by name); ``host`` names the node it serves, or ``None`` when one command fans out to all nodes.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    host: str | None = None


class LauncherBackend(ABC):
    """Base class of launcher backends (``--launcher NAME``)."""

    #: the ``--launcher`` name, equal to the entry-point name
    name: ClassVar[str]
    #: programs that must be on PATH for :meth:`check_available`
    required_programs: ClassVar[tuple[str, ...]] = ()

    def check_available(self) -> None:
        """Raise :class:`UsageError` naming the missing program when this backend cannot run here."""
        for prog in self.required_programs:
            if shutil.which(prog) is None:
                raise UsageError(
                    f"launcher {self.name!r} needs {prog!r} on PATH; install it or pick another --launcher"
                )

    def preflight(self, plan: LaunchPlan) -> None:  # noqa: B027 - optional hook
        """Check the plan can start (e.g. passwordless ssh); raise :class:`UsageError` if not. Starts nothing."""

    @abstractmethod
    def commands(self, plan: LaunchPlan) -> list[Command]:
        """The commands that start one agent per node of ``plan``."""


def available_launchers() -> dict[str, type[LauncherBackend]]:
    """All registered backends by name (loads the entry points)."""
    found: dict[str, type[LauncherBackend]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.load()
    return found


def get_launcher(name: str) -> LauncherBackend:
    """Instantiate the backend registered as ``name``; an unknown name lists the available ones."""
    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in eps:
        names = ", ".join(sorted(eps)) or "none installed"
        raise UsageError(f"unknown --launcher {name!r}; available: {names}")
    cls = eps[name].load()
    return cls()
