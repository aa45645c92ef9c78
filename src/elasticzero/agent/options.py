"""elasticzero-run's own flags on top of torchrun's, and how they become torchrun settings.

:func:`add_agent_flags` extends torch's parser; :func:`resolve` turns the parsed namespace (plus the
environment and this host's facts) into :class:`AgentSettings` and the torchrun fields they imply
(``nproc_per_node``, ``nnodes``, ``node_rank``). Pure: no process is started and nothing is contacted, so
every contradiction is found before launch and reported as a :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from elasticzero.agent.binding import split_cores
from elasticzero.agent.nodetable import (
    HostFacts,
    NodeRow,
    local_host_facts,
    match_local_host,
    parse_node_table,
    rank_from_env,
    rank_of_host,
    resolve_hosts,
)
from elasticzero.errors import UsageError

#: rendezvous backends built on torch's DynamicRendezvousHandler (they read the keys in RDZV_DEFAULTS)
DYNAMIC_BACKENDS = frozenset({"c10d", "elasticzero", "etcd-v2"})

#: rendezvous settings elasticzero-run uses unless --rdzv-conf sets them (or --torch-rdzv-defaults is given):
#: a dead node is noticed after keep_alive_interval * keep_alive_max_attempt = 4 s instead of 15 s, and a round
#: with at least min nodes closes 2 s after the last join instead of 30 s. Keep max_attempt >= 3: a live node's
#: heartbeat is up to 2 intervals old (the keep-alive timer skips a beat when it fires just early), so with 2 a
#: live but busy node can be dropped from the round without noticing.
RDZV_DEFAULTS = {"keep_alive_interval": "1", "keep_alive_max_attempt": "4", "last_call_timeout": "2"}

IDENTITY_FLAGS = ("--node-rank", "--node-rank-env", "--node-host", "--node-host-env")


#: backends whose embedded c10d TCPStore honours ``is_host`` (torch's c10d and our elasticzero handler)
STORE_HOSTING_BACKENDS = frozenset({"c10d", "elasticzero"})


@dataclass(frozen=True)
class AgentSettings:
    """What the agent needs beyond torch's LaunchConfig."""

    job_id: str
    node_rank: int | None  # None: not known before rendezvous (no table, no --node-rank)
    node: NodeRow | None  # this node's row of --node-table
    cpus: list[list[int]] | None  # per-local-rank cores with --bind-cores-to-rank
    health_file: str | None
    rdzv_defaults: bool
    first_host: str | None = None  # the host of --node-table's row 0 (the front-end's default endpoint host)


def add_agent_flags(parser: argparse.ArgumentParser) -> None:
    """Add elasticzero-run's flags to torch's parser (and make the identity flags detectably unset)."""
    g = parser.add_argument_group("elasticzero-run")
    g.add_argument(
        "--node-table", "--node_table", help="JSON [[host,[slot,...]],...] in node-rank order (from elasticzero-launch)"
    )
    g.add_argument(
        "--node-rank-env",
        "--node_rank_env",
        metavar="VAR",
        help="read the node rank from env VAR (OMPI_COMM_WORLD_RANK…)",
    )
    g.add_argument(
        "--node-host", "--node_host", metavar="NAME", help="this node's host name as written in --node-table"
    )
    g.add_argument(
        "--node-host-env",
        "--node_host_env",
        metavar="VAR",
        help="read this node's host name from env VAR (SLURMD_NODENAME)",
    )
    g.add_argument(
        "--bind-cores-to-rank",
        "--bind_cores_to_rank",
        action="store_true",
        help="split this node's cores evenly among the local ranks (sched_setaffinity in each worker)",
    )
    g.add_argument(
        "--health-file", "--health_file", metavar="PATH", help="JSON file kept up to date with the agent's state"
    )
    g.add_argument(
        "--elastic-config",
        "--elastic_config",
        metavar="FILE",
        help="elasticzero YAML / DeepSpeed JSON: fail at start if a world size --nnodes allows has no batch plan",
    )
    g.add_argument(
        "--torch-rdzv-defaults",
        action="store_true",
        help="use torch's rendezvous timeouts instead of elasticzero's faster defaults",
    )
    g.add_argument(
        "--kill-job",
        "--kill_job",
        metavar="JOBID",
        help="(first flag) stop every process of job JOBID on this host, then exit",
    )
    g.add_argument("--grace", type=float, default=5.0, help="with --kill-job: seconds between SIGTERM and SIGKILL")
    # unset detection: torch defaults these (node_rank=0, nproc_per_node="1", nnodes="1:1")
    parser.set_defaults(node_rank=None, nproc_per_node=None, nnodes=None)
    # per-rank log files named by global rank and attempt (elasticzero.agent.logs) unless --logs-specs says otherwise
    parser.set_defaults(logs_specs="elasticzero")


def resolve(
    args: argparse.Namespace,
    env: Mapping[str, str] = os.environ,
    host_facts: Callable[[], HostFacts] = local_host_facts,
    resolver: Callable[[tuple[NodeRow, ...]], Mapping[str, set[str]]] = resolve_hosts,
    cores: Callable[[], list[int]] = lambda: sorted(os.sched_getaffinity(0)),
) -> AgentSettings:
    """Validate our flags, fill torchrun's ``node_rank``/``nproc_per_node``/``nnodes`` in ``args``; return settings."""
    _torch_env_fallbacks(args, env)
    values = (args.node_rank, args.node_rank_env, args.node_host, args.node_host_env)
    given = [flag for flag, value in zip(IDENTITY_FLAGS, values, strict=True) if value is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} contradict each other: give one of {', '.join(IDENTITY_FLAGS)}")
    table = parse_node_table(args.node_table) if args.node_table is not None else None
    node_rank: int | None = args.node_rank
    if args.node_rank_env is not None:
        node_rank = rank_from_env(args.node_rank_env, env)
    if table is None:
        if args.node_host is not None or args.node_host_env is not None:
            raise UsageError(f"{given[0]} needs --node-table to look the host up in")
    else:
        if args.node_host is not None:
            node_rank = rank_of_host(args.node_host, table, "--node-host")
        elif args.node_host_env is not None:
            name = env.get(args.node_host_env)
            if not name:
                raise UsageError(f"--node-host-env {args.node_host_env}: the variable is not set in this environment")
            node_rank = rank_of_host(name, table, f"--node-host-env {args.node_host_env}=")
        elif node_rank is None:
            node_rank = match_local_host(table, host_facts(), resolver(table))
    node = _check_table(args, table, node_rank)
    if node_rank is not None and node_rank < 0:
        raise UsageError(f"node rank must be >= 0, got {node_rank}")
    args.node_rank = node_rank if node_rank is not None else 0
    if args.nproc_per_node is None:
        args.nproc_per_node = "1"
    if args.nnodes is None:
        args.nnodes = str(len(table)) if table is not None else "1:1"
    cpus = None
    if args.bind_cores_to_rank:
        if args.run_path:
            raise UsageError("--bind-cores-to-rank needs a program to exec; it does not work with --run-path")
        if not args.nproc_per_node.isdigit():
            raise UsageError(f"--bind-cores-to-rank needs a numeric --nproc-per-node, got {args.nproc_per_node!r}")
        cpus = split_cores(cores(), int(args.nproc_per_node))
    return AgentSettings(
        job_id=args.rdzv_id,
        node_rank=node_rank,
        node=node,
        first_host=table[0].host if table else None,
        cpus=cpus,
        health_file=args.health_file,
        rdzv_defaults=not args.torch_rdzv_defaults,
    )


def _check_table(args: argparse.Namespace, table: tuple[NodeRow, ...] | None, node_rank: int | None) -> NodeRow | None:
    if table is None or node_rank is None:
        return None
    if not 0 <= node_rank < len(table):
        raise UsageError(f"node rank {node_rank} is outside the node table (0..{len(table) - 1})")
    node = table[node_rank]
    nslots = len(node.slots)
    if args.nproc_per_node is not None and args.nproc_per_node != str(nslots):
        raise UsageError(
            f"--nproc-per-node {args.nproc_per_node} contradicts the node table ({node.host} has {nslots} slots)"
        )
    args.nproc_per_node = str(nslots)
    return node


def _torch_env_fallbacks(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """torchrun reads ``PET_<FLAG>`` for unset flags; keep that for the three flags whose default we unset."""
    for dest, var in (
        ("node_rank", "PET_NODE_RANK"),
        ("nproc_per_node", "PET_NPROC_PER_NODE"),
        ("nnodes", "PET_NNODES"),
    ):
        if getattr(args, dest) is None and var in env:
            value = env[var]
            if dest == "node_rank":
                try:
                    setattr(args, dest, int(value))
                except ValueError:
                    raise UsageError(f"{var}={value!r} is not an integer") from None
            else:
                setattr(args, dest, value)


def rdzv_configs(
    configs: dict[str, object],
    user_keys: set[str],
    settings: AgentSettings,
    backend: str,
    endpoint: str = "",
) -> None:
    """Adjust torch's rendezvous config in place: our defaults, the node-rank hint, ``is_host``, no phantom ``timeout``.

    ``is_host``: when the endpoint host is the node table's first host (``elasticzero-launch``'s default), node 0
    hosts the embedded c10d store — ``is_host=true`` there, ``false`` elsewhere — instead of torch's guess from
    this machine's hostname and addresses (which fails e.g. for a hostfile of IPs on an image mapping the hostname
    to 127.0.1.1: no node matches, every agent is a client). A user-set ``is_host`` wins.
    """
    if backend == "static":
        return
    if "timeout" not in user_keys:
        configs.pop("timeout", None)  # torch's LaunchConfig injects timeout=900 whether or not the user set it
    if settings.rdzv_defaults and backend in DYNAMIC_BACKENDS:
        for key, value in RDZV_DEFAULTS.items():
            configs.setdefault(key, value)
    if settings.node_rank is not None:
        configs["node_rank_hint"] = settings.node_rank
    if (
        backend in STORE_HOSTING_BACKENDS
        and "is_host" not in user_keys
        and settings.node_rank is not None
        and settings.first_host is not None
        and _endpoint_host(endpoint) == _bare_host(settings.first_host)
    ):
        configs["is_host"] = settings.node_rank == 0


def _bare_host(host: str) -> str:
    """``user@host`` → ``host``; IPv6 brackets dropped."""
    return host.rsplit("@", 1)[-1].strip("[]")


def _endpoint_host(endpoint: str) -> str | None:
    """The host of a ``[tcp://]host[:port]`` endpoint (None for other URLs such as ``etcd://…``, or none)."""
    if endpoint.lower().startswith("tcp://"):  # the elasticzero handler's explicit c10d spelling
        endpoint = endpoint[len("tcp://") :]
    if not endpoint or "://" in endpoint:
        return None
    if endpoint.startswith("["):  # [v6]:port
        return endpoint[1 : endpoint.find("]")] if "]" in endpoint else None
    if endpoint.count(":") > 1:  # bare IPv6 without a port
        return endpoint
    return endpoint.split(":", 1)[0] or None
