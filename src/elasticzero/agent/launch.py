"""Our small launch function: torch's ``launch_agent`` shape, running :class:`ElasticZeroAgent`.

torch's ``launch_agent`` hard-codes ``LocalElasticAgent``; this builds the same rendezvous handler and
``WorkerSpec`` from a ``LaunchConfig`` and runs our agent instead. The rendezvous is closed on the way out
(so other nodes stop too) unless the agent was stopped by a signal, as torch does. When this node's workers
failed with restarts exhausted, it first marks the job failed in the round's store
(:meth:`ElasticZeroAgent.announce_failure`) and, after closing, waits a few seconds at most for the other nodes
to see it — it may be the node hosting the embedded store.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port

from elasticzero.agent.agent import MONITOR_HOLD_ENV, ElasticZeroAgent, PeerFailedError


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[str],
    *,
    health_file: str | None = None,
) -> tuple[RunResult, ElasticZeroAgent]:
    """Rendezvous, run the workers under :class:`ElasticZeroAgent` until they finish; return the result."""
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = ElasticZeroAgent(
        spec,
        config.logs_specs,  # type: ignore[arg-type]
        health_file=health_file,
        min_nodes=config.min_nodes,
        monitor_hold_file=os.environ.get(MONITOR_HOLD_ENV),
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
    )
    close_rendezvous = True
    failed = False
    try:
        result = agent.run()
        failed = result is not None and result.is_failed()
        if failed:  # restarts exhausted: tell the other nodes at once (they may sit in the exit barrier)
            agent.announce_failure(result)
        return result, agent
    except SignalException:
        close_rendezvous = False  # closing would end the run for every node; a signalled node just leaves
        raise
    except PeerFailedError:
        # the failing node closes the rendezvous itself, and it may host the store and leave as soon as we saw
        # its mark: closing again would only meet a dead store
        close_rendezvous = False
        raise
    finally:
        agent.remove_health_file()
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
        if failed:  # this node may host the store: stay until the others saw the failure (bounded)
            agent.await_peers_informed()
