"""The launch plan: everything ``elasticzero-launch`` will do, decided before anything starts.

Discovery (hostfile / Slurm allocation / local accelerators) and filters produce the nodes; env rules produce the
exported environment. The backend binds the plan once (``LauncherBackend.bind``): its options checked and typed,
its :class:`Command` argv lists built, into a :class:`BoundPlan`. ``--dry-run`` prints that bound plan, otherwise
that same bound plan is executed. Both are plain data: they can be printed, compared in tests and serialised as
JSON without touching the network.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MASK = "****"


def is_secret(name: str) -> bool:
    """Whether the variable ``name`` looks secret (its value is never printed)."""
    return SECRET_NAME.search(name) is not None


def mask_value(name: str, value: str) -> str:
    """The value to show for ``name`` in logs and dry-run output (secrets are masked)."""
    return MASK if is_secret(name) else value


@dataclass(frozen=True)
class Command:
    """One local process the launcher starts.

    ``env`` holds variables to add to the launcher's own environment for this process (for transports that
    forward by name); ``host`` names the node it serves, or ``None`` when one command fans out to all nodes.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    host: str | None = None


@dataclass(frozen=True)
class NodeSpec:
    """One node of the plan: the host name as the user wrote it, its node rank and the slot ids bound there."""

    host: str
    node_rank: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class AgentOptions:
    """What every node's ``elasticzero-run`` receives besides its identity (torchrun-compatible options)."""

    nnodes: str  # "N" or "MIN:MAX"
    rdzv_backend: str = "elasticzero"
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    #: ``--rdzv-endpoint``'s etcd URL (``etcd://H:P,…``); ``None``: the c10d store at the plan's master address
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    monitor_interval: float | None = None
    peer_timeout: int | None = None  #: ``--peer-timeout`` (elasticzero.agent.liveness); None: the agent's default
    live_recovery: bool = False  #: ``--live-recovery`` (elasticzero.agent.handoff)
    rejoin_timeout: int | None = None  #: ``--rejoin-timeout`` (elasticzero.agent.rejoin); None: the agent's default
    log_dir: str | None = None
    redirects: str | None = None
    tee: str | None = None
    bind_cores_to_rank: bool = False
    module: bool = False
    no_python: bool = False
    python: str = field(default_factory=lambda: sys.executable)


@dataclass(frozen=True)
class LaunchPlan:
    """Hosts in rank order, their slots, the rendezvous endpoint, the exported env and the backend options."""

    job_id: str
    backend: str
    nodes: tuple[NodeSpec, ...]
    master_addr: str
    master_port: int
    entry: tuple[str, ...]  # user script (or module / program) and its arguments, untouched
    cwd: str
    agent: AgentOptions
    env: dict[str, str] = field(default_factory=dict)  # exported name -> value
    launcher_args: tuple[str, ...] = ()  # raw extra args for the transport (--launcher-args), passed as given
    #: backend options: as given (strings or typed values) until the backend binds the plan; a
    #: :attr:`BoundPlan.plan` holds every option the backend declares, checked and typed
    options: dict[str, Any] = field(default_factory=dict)
    #: random per plan: names what a backend stages on the nodes for this run (pdsh's env file)
    #: (``os.urandom`` is what ``secrets.token_hex`` reads; importing ``secrets`` loads OpenSSL: ~10 ms per launch)
    nonce: str = field(default_factory=lambda: os.urandom(8).hex(), compare=False)

    @property
    def world_size(self) -> int:
        return sum(len(n.slots) for n in self.nodes)

    def node_table_json(self) -> str:
        """The node table every agent receives: ``[[host, [slot, …]], …]`` in node-rank order."""
        return json.dumps([[n.host, list(n.slots)] for n in self.nodes], separators=(",", ":"))

    @property
    def rdzv_endpoint(self) -> str:
        """The ``--rdzv-endpoint`` every agent gets: the etcd URL, else the c10d store's ``HOST:PORT``."""
        return self.agent.rdzv_endpoint or f"{_host_for_url(self.master_addr)}:{self.master_port}"

    def agent_argv(self, identity: list[str]) -> list[str]:
        """The ``elasticzero-run`` argv for a node.

        ``identity`` tells the agent which node of the node table it is, chosen by the backend:
        ``["--node-rank", "1"]`` (one command per node), ``["--node-rank-env", "OMPI_COMM_WORLD_RANK"]``,
        ``["--node-host-env", "SLURMD_NODENAME"]`` or ``["--node-host", "%h"]`` (pdsh substitutes it).
        """
        a = self.agent
        # frozen_modules=off: torch's rendezvous names each event it records by inspect.stack(), and the frozen
        # runpy frames under ``-m`` make every such call scan sys.modules (~20 ms each, ~0.15 s per start)
        argv = [a.python, "-u", "-X", "frozen_modules=off", "-m", "elasticzero.agent.cli"]
        argv += ["--nnodes", a.nnodes, "--node-table", self.node_table_json(), *identity]
        argv += ["--rdzv-backend", a.rdzv_backend, "--rdzv-endpoint", self.rdzv_endpoint]
        argv += ["--rdzv-id", self.job_id]
        if a.rdzv_conf:
            argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in a.rdzv_conf)]
        argv += ["--max-restarts", str(a.max_restarts)]
        if a.monitor_interval is not None:
            argv += ["--monitor-interval", str(a.monitor_interval)]
        if a.peer_timeout is not None:
            argv += ["--peer-timeout", str(a.peer_timeout)]
        if a.rejoin_timeout is not None:
            argv += ["--rejoin-timeout", str(a.rejoin_timeout)]
        if a.live_recovery:
            argv += ["--live-recovery"]
        if a.log_dir:
            argv += ["--log-dir", a.log_dir]
        if a.redirects:
            argv += ["--redirects", a.redirects]
        if a.tee:
            argv += ["--tee", a.tee]
        if a.bind_cores_to_rank:
            argv.append("--bind-cores-to-rank")
        if a.module:
            argv.append("--module")
        if a.no_python:
            argv.append("--no-python")
        return [*argv, *self.entry]

    def to_json(self) -> dict[str, Any]:
        """The plan's part of what ``--dry-run=json`` prints (secret env values and options masked)."""
        return {
            "job_id": self.job_id,
            "backend": self.backend,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "rdzv_backend": self.agent.rdzv_backend,
            "rdzv_endpoint": self.rdzv_endpoint,
            "nodes": [{"host": n.host, "node_rank": n.node_rank, "slots": list(n.slots)} for n in self.nodes],
            "env": {k: mask_value(k, v) for k, v in sorted(self.env.items())},
            "options": {k: MASK if is_secret(k) else v for k, v in sorted(self.options.items())},
            "cwd": self.cwd,
        }


@dataclass(frozen=True)
class BoundPlan:
    """A plan bound to its backend, once: what ``--dry-run`` prints and ``execute`` runs.

    Made by ``LauncherBackend.bind``: ``plan.options`` holds every option the backend declares, checked and
    typed; ``commands`` are the argv lists the backend built for it, with the real environment values in each
    ``Command.env`` and none in any argv. Every backend hook (``preflight``, ``stage``, ``unstage``,
    ``stop_job``) receives it, so nothing is checked or built twice. Only the launcher's own ``save_pid`` may be
    settled afterwards (a bare ``--save-pid`` gets its path when execution starts); the commands stay these.
    """

    plan: LaunchPlan
    commands: tuple[Command, ...]

    def to_json(self) -> dict[str, Any]:
        """What ``--dry-run=json`` prints: the plan (secrets masked) and the argv of every command, verbatim."""
        return {**self.plan.to_json(), "commands": [list(c.argv) for c in self.commands]}


def _host_for_url(host: str) -> str:
    """Bracket an IPv6 literal so ``host:port`` stays unambiguous."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
