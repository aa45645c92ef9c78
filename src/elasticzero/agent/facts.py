"""What ``elasticzero-run`` probes on this machine before planning: the thin I/O in front of the pure plan.

:func:`probe_facts` reads only what the command line needs (host names and the table hosts' addresses only when
the node must find itself in ``--node-table``; the CPU affinity only with ``--bind-cores-to-rank``; a device count
only for ``--nproc-per-node cpu|gpu|xpu|auto``) and returns :class:`~elasticzero.agent.plan.AgentFacts`.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Mapping

from elasticzero.agent.binding import package_root
from elasticzero.agent.nodetable import NodeRow, local_host_facts, parse_node_table, resolve_hosts
from elasticzero.agent.plan import NO_HOST, AgentFacts, needs_host_match, requested_nproc
from elasticzero.errors import UsageError
from elasticzero.torchcompat import shutdown_timeout_settable


def probe_facts(args: argparse.Namespace, environ: Mapping[str, str]) -> AgentFacts:
    """Probe this machine for what :func:`~elasticzero.agent.plan.plan_agent` will need for ``args``."""
    table = _table(args.node_table)
    match = table is not None and needs_host_match(args, environ)
    word = requested_nproc(args, environ)
    count = table is None and word is not None and not word.strip().lstrip("+-").isdigit()
    return AgentFacts(
        pid=os.getpid(),
        python=sys.executable,
        package_root=package_root(),
        run_id=str(uuid.uuid4()),
        host=local_host_facts() if match else NO_HOST,
        table_addresses=_addresses(table) if table is not None and match else {},
        cores=tuple(sorted(os.sched_getaffinity(0))) if args.bind_cores_to_rank else (),
        device_count=_device_count(str(word)) if count else None,
        shutdown_timeout_settable=shutdown_timeout_settable(),
    )


def _addresses(table: tuple[NodeRow, ...]) -> dict[str, frozenset[str]]:
    return {host: frozenset(addrs) for host, addrs in resolve_hosts(table).items()}


def _table(text: str | None) -> tuple[NodeRow, ...] | None:
    """The node table, or None when absent or malformed (the plan reports a malformed one)."""
    if text is None:
        return None
    try:
        return parse_node_table(text)
    except UsageError:
        return None


def _device_count(word: str) -> int:
    """torch's local world size for ``--nproc-per-node`` ``cpu``, ``gpu``, ``xpu``, ``auto`` (its own probe)."""
    from torch.distributed.run import determine_local_world_size

    try:
        return int(determine_local_world_size(word))
    except ValueError as exc:
        raise UsageError(f"--nproc-per-node {word}: {exc}") from None
