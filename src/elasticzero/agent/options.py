"""elasticzero-run's own flags on top of torchrun's, and the rendezvous config they imply.

:func:`add_agent_flags` extends torch's parser; :func:`rdzv_config` is the rule for the config the rendezvous
handler is built with. The whole plan (identity, workers, rendezvous) is :func:`elasticzero.agent.plan.plan_agent`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from elasticzero.agent.liveness import DEFAULT_PEER_TIMEOUT_S, PeerPlan, keep_alive_for
from elasticzero.errors import UsageError

#: rendezvous backends built on torch's DynamicRendezvousHandler (they read the keys in RDZV_DEFAULTS)
DYNAMIC_BACKENDS = frozenset({"c10d", "elasticzero", "etcd-v2"})

#: rendezvous settings elasticzero-run uses unless --rdzv-conf sets them (or --torch-rdzv-defaults is given):
#: a dead node is noticed after keep_alive_interval * keep_alive_max_attempt = 4 s instead of 15 s, and a round
#: with at least min nodes closes 2 s after the last join instead of 30 s. Keep max_attempt >= 3: a live node's
#: heartbeat is up to 2 intervals old (the keep-alive timer skips a beat when it fires just early), so with 2 a
#: live but busy node can be dropped from the round without noticing.
#: The keep-alive pair is the default peer timeout's (elasticzero.agent.liveness).
RDZV_DEFAULTS = {
    "keep_alive_interval": str(keep_alive_for(DEFAULT_PEER_TIMEOUT_S)[0]),
    "keep_alive_max_attempt": str(keep_alive_for(DEFAULT_PEER_TIMEOUT_S)[1]),
    "last_call_timeout": "2",
}

#: with ``--live-recovery`` the last call is 1 s: there a node that misses a round costs one more hand-off (the
#: workers' own part is ~0.15 s), not a restart of every worker, so the round closes sooner and a loss is trained
#: past within the 5 s goal at the default 4 s peer timeout (docs/agent.md, "Live recovery"). --rdzv-conf wins. A
#: hand-off's re-formation does not wait it out once every node expected is in (agent/prompt.py).
LIVE_RDZV_DEFAULTS = {**RDZV_DEFAULTS, "last_call_timeout": "1"}

IDENTITY_FLAGS = ("--node-rank", "--node-rank-env", "--node-host", "--node-host-env")


#: backends whose embedded c10d TCPStore honours ``is_host`` (torch's c10d and our elasticzero handler)
STORE_HOSTING_BACKENDS = frozenset({"c10d", "elasticzero"})

#: the rendezvous timeout torchrun's ``LaunchConfig`` puts into a static rendezvous's config when none is given
TORCHRUN_RDZV_TIMEOUT = 900


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
        "--collective-timeout",
        "--collective_timeout",
        metavar="SECONDS",
        help="how long a worker's collective may wait for its peers before it fails "
        "(the process group's timeout; default: $ELASTICZERO_COLLECTIVE_TIMEOUT, else 300)",
    )
    g.add_argument(
        "--hang-timeout",
        "--hang_timeout",
        metavar="SECONDS",
        help="a worker without progress this long (steps, engine collectives, elasticzero.heartbeat()) on this live "
        "node is hung: its stacks are dumped and the job restarts from its checkpoint (default: 10 x the longest step "
        "seen, at least 30; 'off' disables)",
    )
    g.add_argument(
        "--peer-timeout",
        "--peer_timeout",
        metavar="SECONDS",
        help="a node whose agent sends no rendezvous heartbeat for this long is gone: the others stop their workers "
        "and re-form without it, no restart spent (whole seconds >= 3; heartbeat every ~1/4 of it; default 4, or "
        "what --rdzv-conf keep_alive_interval * keep_alive_max_attempt gives; torch's 15 with --torch-rdzv-defaults)",
    )
    g.add_argument(
        "--rejoin-timeout",
        "--rejoin_timeout",
        metavar="SECONDS",
        help="cut off from the rendezvous (its store silent for the peer timeout), this node stops its workers and "
        "tries to join again as a new node for this long (whole seconds; default: the rendezvous's join timeout; "
        "0: exit at once)",
    )
    g.add_argument(
        "--live-recovery",
        "--live_recovery",
        action="store_true",
        help="on a membership change (a peer gone, nodes joining) keep the workers running and hand them the new "
        "round in a file (ELASTICZERO_ROUND_FILE) instead of restarting them; needs a dynamic rendezvous",
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
    g.add_argument(
        "--dry-run",
        "--dry_run",
        action="store_true",
        help="print this node's plan (rendezvous, workers' command and environment) as JSON and exit; start nothing",
    )
    # unset detection: torch defaults these (node_rank=0, nproc_per_node="1", nnodes="1:1"; master_port 29500 before
    # torch 2.12, unset since, so the single-node shortcut works alike on every torch)
    parser.set_defaults(node_rank=None, nproc_per_node=None, nnodes=None, master_port=None)
    # per-rank log files named by global rank and attempt (elasticzero.agent.logs) unless --logs-specs says otherwise
    parser.set_defaults(logs_specs="elasticzero")


def rdzv_config(
    user: Mapping[str, str],
    backend: str,
    endpoint: str,
    *,
    node_rank: int | None,
    first_host: str | None,
    torch_defaults: bool,
    peers: PeerPlan | None = None,
    live: bool = False,
) -> dict[str, object]:
    """The rendezvous config the handler is built with: ``--rdzv-conf`` (``user``) plus ours, as a new dict.

    Static: torchrun's ``rank`` and ``timeout``. Dynamic backends: our defaults (:data:`RDZV_DEFAULTS`, with
    ``live`` recovery :data:`LIVE_RDZV_DEFAULTS`) unless ``torch_defaults``; the keep-alive settings
    ``--peer-timeout`` derives (``peers``, :func:`elasticzero.agent.liveness.peer_plan`: it already checked them
    against the user's); the node-rank hint; ``is_host``; and no ``timeout`` nobody set (torchrun's ``LaunchConfig``
    injects ``timeout=900`` whether or not the user wrote it).

    ``is_host``: when the endpoint host is the node table's first host (``elasticzero-launch``'s default), node 0
    hosts the embedded c10d store — ``is_host=true`` there, ``false`` elsewhere — instead of torch's guess from
    this machine's hostname and addresses (which fails e.g. for a hostfile of IPs on an image mapping the hostname
    to 127.0.1.1: no node matches, every agent is a client). A user-set ``is_host`` wins.
    """
    if backend == "static":
        return {"timeout": TORCHRUN_RDZV_TIMEOUT, **user, "rank": node_rank or 0}
    config: dict[str, object] = dict(user)
    if not torch_defaults and backend in DYNAMIC_BACKENDS:
        config = {**(LIVE_RDZV_DEFAULTS if live else RDZV_DEFAULTS), **config}
    if peers is not None and peers.source == "--peer-timeout" and backend in DYNAMIC_BACKENDS:
        config.update(peers.rdzv_conf())  # the keep-alive age torch drops a node at is the peer timeout
    if node_rank is not None:
        config["node_rank_hint"] = node_rank
    if (
        backend in STORE_HOSTING_BACKENDS
        and "is_host" not in user
        and node_rank is not None
        and first_host is not None
        and _endpoint_host(endpoint) == _bare_host(first_host)
    ):
        config["is_host"] = node_rank == 0
    return config


def _bare_host(host: str) -> str:
    """``user@host`` → ``host``; IPv6 brackets dropped."""
    return host.rsplit("@", 1)[-1].strip("[]")


def store_in_agent(backend: str, endpoint: str) -> str | None:
    """The ``host:port`` of a c10d store an agent hosts (backends with an embedded TCPStore, a TCP endpoint)."""
    if backend not in STORE_HOSTING_BACKENDS or _endpoint_host(endpoint) is None:
        return None
    return endpoint[len("tcp://") :] if endpoint.lower().startswith("tcp://") else endpoint


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


def whole_seconds(text: str, what: str, zero: str = "") -> int:
    """``text`` as a whole number of seconds >= 0, else one line naming ``what`` (``zero``: what 0 means, if named)."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{what} {text!r}: not a whole number of seconds") from None
    if value < 0:
        raise UsageError(f"{what} {value}: must be >= 0 seconds" + (f" ({zero})" if zero else ""))
    return value
