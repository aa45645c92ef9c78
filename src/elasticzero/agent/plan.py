"""The agent plan: everything ``elasticzero-run`` will do on this node, decided before anything starts.

:func:`plan_agent` is a pure function of the parsed command line, the environment (a mapping, read only) and
:class:`AgentFacts` — what :func:`elasticzero.agent.facts.probe_facts` found on this machine beforehand (thin I/O).
It mutates neither ``args`` nor the environment, and the same inputs give an equal plan. Every contradiction is a
:class:`~elasticzero.errors.UsageError` here, so nothing starts on bad input; ``elasticzero-run --dry-run`` prints
the plan (:meth:`AgentPlan.to_json`), otherwise :func:`elasticzero.agent.launch.launch` runs it.

torchrun's part of the plan (``nnodes``, the rendezvous target of ``--standalone``, the rendezvous config, the
worker command, logs and the other ``LaunchConfig`` fields) follows ``torch.distributed.run.config_from_args``, as
data instead of a ``LaunchConfig`` built with side effects (that function sets ``OMP_NUM_THREADS`` in the process
environment and ``DefaultLogsSpecs`` creates a log directory); ``tests/unit/agent/test_plan.py`` checks the two
agree.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from elasticzero.agent.agentdirs import agent_dir
from elasticzero.agent.binding import SHIM_STUB, node_env, split_cores, worker_env
from elasticzero.agent.collective import CollectivePlan, collective_plan
from elasticzero.agent.handoff import LivePlan, live_plan
from elasticzero.agent.liveness import PeerPlan, peer_plan
from elasticzero.agent.nodetable import (
    HostFacts,
    NodeRow,
    match_local_host,
    parse_node_table,
    rank_from_env,
    rank_of_host,
)
from elasticzero.agent.options import DYNAMIC_BACKENDS, IDENTITY_FLAGS, rdzv_config, store_in_agent, whole_seconds
from elasticzero.agent.progress import NO_HANG, HangPlan, hang_plan
from elasticzero.agent.rejoin import DEFAULT_REJOIN, RejoinPlan, rejoin_plan
from elasticzero.errors import UsageError
from elasticzero.proc import check_job_id
from elasticzero.torchcompat import DEFAULT_SHUTDOWN_TIMEOUT

#: test hook (docs/agent.md): while the file this names exists, each monitor tick waits (after creating ``<file>.held``)
MONITOR_HOLD_ENV = "ELASTICZERO_TEST_MONITOR_HOLD"
#: torch >= 2.4 lets workers reuse the rank-0 agent's rendezvous TCPStore without a per-round key prefix: after a
#: restart the new workers read the dead workers' gloo/NCCL keys and hang. A fresh store per round avoids it.
SHARE_STORE_KNOB = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
SIGNALS_KNOB = "TORCHELASTIC_SIGNALS_TO_HANDLE"
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_STANDALONE_ENDPOINT = "localhost:0"
_STATIC_MASTER_PORT = 29500  # torchrun's --master-port default


#: host facts not probed (the node's identity was given)
NO_HOST = HostFacts(frozenset(), frozenset())


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy (the plan is frozen all the way down; compares equal to a dict with the same items)."""
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class AgentFacts:
    """What this machine says, probed before planning (:func:`elasticzero.agent.facts.probe_facts`)."""

    pid: int  #: the agent's pid (the workers' cleanup scope)
    python: str  #: this interpreter (torchrun's worker interpreter unless ``PYTHON_EXEC``; runs the exec shim)
    package_root: str  #: the directory the exec shim imports elasticzero from
    run_id: str  #: a fresh id: the rendezvous id of ``--standalone`` and single-node static runs (torchrun's rule)
    host: HostFacts = NO_HOST  #: names and addresses (probed when this node must find itself in the node table)
    table_addresses: Mapping[str, frozenset[str]] = field(default_factory=dict)  #: node-table host → its addresses
    cores: tuple[int, ...] = ()  #: this process's CPU affinity (probed with ``--bind-cores-to-rank``)
    device_count: int | None = None  #: torch's count for ``--nproc-per-node cpu|gpu|xpu|auto`` (probed for a word)
    #: whether this torch takes a workers' stop grace (:func:`elasticzero.torchcompat.shutdown_timeout_settable`)
    shutdown_timeout_settable: bool = True


@dataclass(frozen=True)
class RendezvousPlan:
    """What the rendezvous handler is built from (torch's ``RendezvousParameters``)."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    config: Mapping[str, object]  #: ``--rdzv-conf`` plus the node-rank hint, ``is_host`` and our defaults


@dataclass(frozen=True)
class LogsPlan:
    """The ``LogsSpecs`` to build (``--logs-specs`` names a ``torchrun.logs_specs`` entry point)."""

    specs: str | None
    log_dir: str
    redirects: str
    tee: str
    local_ranks_filter: frozenset[int] | None
    #: ``log_dir`` is the agent's own folder (no ``--log-dir``: :mod:`~elasticzero.agent.agentdirs`), removed when
    #: the agent ends where it holds no file
    owned: bool = False


@dataclass(frozen=True)
class WorkersPlan:
    """The local worker group: what runs, how many, and what elasticzero adds to each worker's environment."""

    nproc_per_node: int
    entrypoint: str | None  #: ``None``: ``--run-path`` (torch's ``run_script_path`` in the agent's interpreter)
    args: tuple[str, ...]
    #: added to every worker's environment (job id, agent pid, torchrun's OMP_NUM_THREADS, the collective timeout and
    #: torch's NCCL error handling: :attr:`AgentPlan.collective`)
    env: Mapping[str, str]
    devices: tuple[int, ...] | None  #: the node's slots (``CUDA_VISIBLE_DEVICES``), from ``--node-table``
    cpus: tuple[tuple[int, ...], ...] | None  #: each local rank's cores (``--bind-cores-to-rank``)
    virtual_local_rank: bool
    role: str
    start_method: str
    numa_binding: str | None
    duplicate_stdout_filters: tuple[str, ...]
    duplicate_stderr_filters: tuple[str, ...]
    log_line_prefix_template: str | None
    logs: LogsPlan
    #: the hang watch the workers report progress to (each local rank's record file, in its environment)
    hang: HangPlan = NO_HANG
    #: ``--live-recovery``: this node's round file (in every worker's environment); None: off
    live: LivePlan | None = None

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """What local rank ``local_rank`` gets on top of torch's variables (the agent's start hook adds it)."""
        env = worker_env(self.env, local_rank, self.devices, self.cpus, self.virtual_local_rank)
        live = self.live.worker_env() if self.live is not None else {}
        return {**env, **self.hang.worker_env(local_rank), **live}


@dataclass(frozen=True)
class AgentPlan:
    """This node's agent: identity, rendezvous, workers, restarts, and the agent process's own torch knobs."""

    job_id: str
    node_rank: int | None  #: None: not known before the rendezvous (no node table, no ``--node-rank``)
    node: NodeRow | None  #: this node's row of ``--node-table``
    rdzv: RendezvousPlan
    workers: WorkersPlan
    max_restarts: int
    monitor_interval: float
    shutdown_timeout: int  #: seconds between SIGTERM and SIGKILL when the workers are stopped
    event_log_handler: str
    #: torch's knobs for the agent process, which torch reads with ``os.getenv`` (the fresh workers' store per
    #: round, the signals torch's process context handles); the workers' environment is :attr:`workers`
    torch_knobs: Mapping[str, str]
    collective: CollectivePlan  #: the workers' collective timeout and NCCL error handling (also in ``workers.env``)
    #: peer liveness (dynamic rendezvous only): the peer timeout and the heartbeat carrying it (also in ``rdzv``)
    peers: PeerPlan | None = None
    health_file: str | None = None
    monitor_hold_file: str | None = None  #: the test hook :data:`MONITOR_HOLD_ENV`
    elastic_config: str | None = None
    error_file: str | None = None  #: the agent's own ``TORCHELASTIC_ERROR_FILE`` (the root cause is copied there)
    #: how long a node cut off from its rendezvous tries to join again (:mod:`elasticzero.agent.rejoin`)
    rejoin: RejoinPlan = DEFAULT_REJOIN

    def to_json(self) -> dict[str, Any]:
        """The plan as ``elasticzero-run --dry-run`` prints it."""
        w = self.workers
        return {
            "job_id": self.job_id,
            "node_rank": self.node_rank,
            "node": None if self.node is None else {"host": self.node.host, "slots": list(self.node.slots)},
            "rendezvous": {**_plain(self.rdzv), "config": dict(self.rdzv.config)},
            "workers": {
                **{k: v for k, v in _plain(w).items() if k not in ("entrypoint", "args")},
                "command": [w.entrypoint or "<run_script_path>", *w.args],
                "env": {str(r): w.worker_env(r) for r in range(w.nproc_per_node)},
                "logs": _plain(w.logs),
            },
            "max_restarts": self.max_restarts,
            "monitor_interval": self.monitor_interval,
            "shutdown_timeout": self.shutdown_timeout,
            "event_log_handler": self.event_log_handler,
            "torch_knobs": dict(self.torch_knobs),
            "collective": {**_plain(self.collective), "env": dict(self.collective.env)},
            "hang": _plain(w.hang),
            "peers": None if self.peers is None else _plain(self.peers),
            "rejoin": _plain(self.rejoin),
            "live_recovery": None if w.live is None else {**_plain(w.live), "round_file": w.live.round_file},
            "health_file": self.health_file,
            "elastic_config": self.elastic_config,
        }

    def to_text(self) -> str:
        """:meth:`to_json` as printed."""
        return json.dumps(self.to_json(), indent=2)


def _plain(obj: Any) -> dict[str, Any]:
    """A plan part's scalar fields (tuples as lists), for :meth:`AgentPlan.to_json`."""
    out: dict[str, Any] = {}
    for name, value in vars(obj).items():
        if isinstance(value, str | int | float | bool | type(None)):
            out[name] = value
        elif isinstance(value, tuple | frozenset):
            out[name] = (
                sorted(value)
                if isinstance(value, frozenset)
                else [list(v) if isinstance(v, tuple) else v for v in value]
            )
    return out


# -- identity: which row of --node-table this node is ------------------------------------------------------------


def _pet(args: argparse.Namespace, environ: Mapping[str, str], dest: str) -> str | None:
    """torchrun reads ``PET_<FLAG>`` for unset flags; kept for the four flags whose default we unset."""
    value = getattr(args, dest)
    return str(value) if value is not None else environ.get(f"PET_{dest.upper()}")


def _node_rank_flag(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    value = _pet(args, environ, "node_rank")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"PET_NODE_RANK={value!r} is not an integer") from None


def needs_host_match(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """Whether this node finds its row by matching its own names and addresses (no identity flag given)."""
    flags = (_pet(args, environ, "node_rank"), args.node_rank_env, args.node_host, args.node_host_env)
    return args.node_table is not None and all(v is None for v in flags)


def _identity(
    args: argparse.Namespace, environ: Mapping[str, str], facts: AgentFacts, table: tuple[NodeRow, ...] | None
) -> int | None:
    """This node's rank from the one identity flag given, or by matching this host against the table."""
    node_rank = _node_rank_flag(args, environ)
    values = (node_rank, args.node_rank_env, args.node_host, args.node_host_env)
    given = [flag for flag, value in zip(IDENTITY_FLAGS, values, strict=True) if value is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} contradict each other: give one of {', '.join(IDENTITY_FLAGS)}")
    if args.node_rank_env is not None:
        return rank_from_env(args.node_rank_env, environ)
    if table is None:
        if given and given[0] in ("--node-host", "--node-host-env"):
            raise UsageError(f"{given[0]} needs --node-table to look the host up in")
        return node_rank
    if args.node_host is not None:
        return rank_of_host(args.node_host, table, "--node-host")
    if args.node_host_env is not None:
        name = environ.get(args.node_host_env)
        if not name:
            raise UsageError(f"--node-host-env {args.node_host_env}: the variable is not set in this environment")
        return rank_of_host(name, table, f"--node-host-env {args.node_host_env}=")
    if node_rank is not None:
        return node_rank
    return match_local_host(table, facts.host, facts.table_addresses)


def _row(table: tuple[NodeRow, ...] | None, node_rank: int | None) -> NodeRow | None:
    if node_rank is not None and node_rank < 0:
        raise UsageError(f"node rank must be >= 0, got {node_rank}")
    if table is None or node_rank is None:
        return None
    if node_rank >= len(table):
        raise UsageError(f"node rank {node_rank} is outside the node table (0..{len(table) - 1})")
    return table[node_rank]


# -- torchrun's fields ---------------------------------------------------------------------------------------------


def requested_nproc(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """``--nproc-per-node`` as given (or ``PET_NPROC_PER_NODE``); None when unset."""
    return _pet(args, environ, "nproc_per_node")


def _nproc(args: argparse.Namespace, environ: Mapping[str, str], facts: AgentFacts, node: NodeRow | None) -> int:
    """The local world size: the node's slot count with a table, else torchrun's ``--nproc-per-node``."""
    requested = requested_nproc(args, environ)
    if node is not None:
        if requested is not None and requested != str(len(node.slots)):
            raise UsageError(
                f"--nproc-per-node {requested} contradicts the node table ({node.host} has {len(node.slots)} slots)"
            )
        return len(node.slots)
    if requested is None:
        return 1
    try:
        return int(requested)
    except ValueError:
        if facts.device_count is None:
            raise UsageError(f"--nproc-per-node {requested!r}: not a number, and no device count was probed") from None
        return facts.device_count


def _nnodes(
    args: argparse.Namespace, environ: Mapping[str, str], table: tuple[NodeRow, ...] | None
) -> tuple[str, int, int]:
    """``--nnodes`` text (defaults: the table length, else torchrun's ``1:1``) and its min and max."""
    text = _pet(args, environ, "nnodes") or (str(len(table)) if table is not None else "1:1")
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: give N or MIN:MAX") from None
    if len(parts) > 2 or not 0 < low <= high:
        raise UsageError(f"--nnodes {text!r}: give N or MIN:MAX with 0 < MIN <= MAX")
    return text, low, high


def _rdzv_target(
    args: argparse.Namespace, environ: Mapping[str, str], facts: AgentFacts, nnodes: str
) -> tuple[str, str, str]:
    """Backend, endpoint and run id: torchrun's ``--standalone`` and single-node shortcuts applied."""
    master_port = _pet(args, environ, "master_port")
    single_static = args.rdzv_backend == "static" and not args.rdzv_endpoint and master_port is None
    if args.standalone or (single_static and nnodes.split(":")[-1] == "1"):
        return "c10d", _STANDALONE_ENDPOINT, facts.run_id
    endpoint = args.rdzv_endpoint
    if args.rdzv_backend == "static" and not endpoint:
        endpoint = f"{args.master_addr}:{master_port or _STATIC_MASTER_PORT}"
    return args.rdzv_backend, endpoint, args.rdzv_id


def _user_rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf`` parsed exactly as torchrun does."""
    from torch.distributed.run import _parse_rendezvous_config

    try:
        return dict(_parse_rendezvous_config(text))
    except ValueError as exc:
        raise UsageError(f"--rdzv-conf {text!r}: {exc}") from None


def _ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise UsageError(
            f"--local-ranks-filter {text!r}: give a comma-separated list of integers, e.g. 0,1,2"
        ) from None


def _command(
    args: argparse.Namespace, environ: Mapping[str, str], facts: AgentFacts
) -> tuple[str | None, tuple[str, ...]]:
    """The worker command (torchrun's rule), wrapped in the exec shim; ``None`` entrypoint for ``--run-path``."""
    script_args = tuple(args.training_script_args)
    if args.run_path:
        return None, (args.training_script, *script_args)
    if args.no_python:
        if args.module:
            raise UsageError("--no-python and --module cannot be used together")
        cmd, cmd_args = args.training_script, script_args
    else:
        cmd = environ.get("PYTHON_EXEC", facts.python)
        cmd_args = ("-u", *(("-m",) if args.module else ()), args.training_script, *script_args)
    return facts.python, ("-S", "-c", SHIM_STUB, facts.package_root, "--", cmd, *cmd_args)


def _cpus(args: argparse.Namespace, facts: AgentFacts, nproc: int) -> tuple[tuple[int, ...], ...] | None:
    if not args.bind_cores_to_rank:
        return None
    if args.run_path:
        raise UsageError("--bind-cores-to-rank needs a program to exec; it does not work with --run-path")
    if not facts.cores:
        raise UsageError("--bind-cores-to-rank: this process may run on no core (empty CPU affinity)")
    return tuple(tuple(chunk) for chunk in split_cores(facts.cores, nproc))


def _numa(value: str | None) -> str | None:
    if value is None:
        return None
    from torch.numa.binding import AffinityMode

    try:
        return AffinityMode(value).value
    except ValueError:
        raise UsageError(f"--numa-binding {value!r}: use one of {', '.join(m.value for m in AffinityMode)}") from None


def _shutdown_timeout(flag: int | None, environ: Mapping[str, str], settable: bool) -> int:
    """``--shutdown-timeout``, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s (torchrun's ``LaunchConfig``);
    torch's fixed grace where it takes none (torch 2.11, which has neither the flag nor the variable)."""
    if not settable:
        return DEFAULT_SHUTDOWN_TIMEOUT
    if flag is not None:
        name, text = "--shutdown-timeout", str(flag)
    else:
        name, text = SHUTDOWN_ENV, environ.get(SHUTDOWN_ENV, str(DEFAULT_SHUTDOWN_TIMEOUT))
    return whole_seconds(text, name)


def _workers(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    facts: AgentFacts,
    job_id: str,
    node: NodeRow | None,
    collective: CollectivePlan,
    live: LivePlan | None = None,
) -> WorkersPlan:
    nproc = _nproc(args, environ, facts, node)
    entrypoint, entry_args = _command(args, environ, facts)
    env = {**node_env(job_id, facts.pid), **collective.env}
    if "OMP_NUM_THREADS" not in environ and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, set for the workers only
    return WorkersPlan(
        nproc_per_node=nproc,
        entrypoint=entrypoint,
        args=entry_args,
        env=_frozen(env),
        devices=node.slots if node is not None else None,
        cpus=_cpus(args, facts, nproc),
        virtual_local_rank=bool(args.virtual_local_rank),
        role=args.role,
        start_method=args.start_method,
        numa_binding=_numa(args.numa_binding),
        duplicate_stdout_filters=tuple(args.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(args.duplicate_stderr_filters),
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        logs=_logs(args, environ, job_id, facts.pid),
        hang=hang_plan(args.hang_timeout, environ, job_id, facts.pid),
        live=live,
    )


def _logs(args: argparse.Namespace, environ: Mapping[str, str], job_id: str, agent_pid: int) -> LogsPlan:
    """``--log-dir``, else the agent's own logs folder (torch's default, a ``torchelastic_*`` folder, is never
    removed: one per agent start)."""
    owned = not args.log_dir
    log_dir = agent_dir(environ, "logs", job_id, agent_pid) if owned else args.log_dir
    return LogsPlan(args.logs_specs, log_dir, args.redirects, args.tee, _ranks_filter(args.local_ranks_filter), owned)


def _peers(args: argparse.Namespace, backend: str, endpoint: str, user_conf: Mapping[str, str]) -> PeerPlan | None:
    """Peer liveness for a dynamic rendezvous (:mod:`elasticzero.agent.liveness`); ``None`` for static ones."""
    if backend not in DYNAMIC_BACKENDS:
        if args.peer_timeout is not None:
            raise UsageError(f"--peer-timeout needs a dynamic rendezvous ({', '.join(sorted(DYNAMIC_BACKENDS))})")
        return None
    return peer_plan(args.peer_timeout, user_conf, args.torch_rdzv_defaults, store_in_agent(backend, endpoint))


def plan_agent(args: argparse.Namespace, environ: Mapping[str, str], facts: AgentFacts) -> AgentPlan:
    """This node's :class:`AgentPlan` (pure: see the module docstring); bad input raises :class:`UsageError`."""
    table = parse_node_table(args.node_table) if args.node_table is not None else None
    node_rank = _identity(args, environ, facts, table)
    node = _row(table, node_rank)
    nnodes, min_nodes, max_nodes = _nnodes(args, environ, table)
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: must be >= 0")
    backend, endpoint, run_id = _rdzv_target(args, environ, facts, nnodes)
    job_id = check_job_id(run_id, "--rdzv-id")
    user_conf = _user_rdzv_conf(args.rdzv_conf)
    peers = _peers(args, backend, endpoint, user_conf)
    config = rdzv_config(
        user_conf,
        backend,
        endpoint,
        node_rank=node_rank,
        first_host=table[0].host if table else None,
        torch_defaults=args.torch_rdzv_defaults,
        peers=peers,
        live=bool(args.live_recovery),
    )
    collective = collective_plan(args.collective_timeout, environ)
    live = live_plan(args.live_recovery, backend, peers, environ, job_id, facts.pid)
    return AgentPlan(
        job_id=job_id,
        node_rank=node_rank,
        node=node,
        rdzv=RendezvousPlan(backend, endpoint, run_id, min_nodes, max_nodes, args.local_addr, _frozen(config)),
        workers=_workers(args, environ, facts, job_id, node, collective, live),
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        shutdown_timeout=_shutdown_timeout(args.shutdown_timeout, environ, facts.shutdown_timeout_settable),
        event_log_handler=args.event_log_handler,
        torch_knobs=_frozen(
            {SHARE_STORE_KNOB: environ.get(SHARE_STORE_KNOB, "1"), SIGNALS_KNOB: args.signals_to_handle}
        ),
        collective=collective,
        peers=peers,
        health_file=args.health_file,
        monitor_hold_file=environ.get(MONITOR_HOLD_ENV),
        elastic_config=args.elastic_config,
        error_file=environ.get("TORCHELASTIC_ERROR_FILE"),
        rejoin=rejoin_plan(args.rejoin_timeout, user_conf),
    )
