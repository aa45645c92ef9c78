"""Our small launch function: torch's ``launch_agent`` shape, running :class:`ElasticZeroAgent` from an agent plan.

torch's ``launch_agent`` hard-codes ``LocalElasticAgent``; this builds the rendezvous handler, the ``LogsSpecs``
and the ``WorkerSpec`` from an :class:`~elasticzero.agent.plan.AgentPlan` (as torch builds them from a
``LaunchConfig``) and runs our agent instead; the plan's worker environment goes to the agent's start hook. The
rendezvous is closed on the way out (so other nodes stop too) unless the agent was stopped by a signal, as torch
does. When this node's workers failed with restarts exhausted, it first marks the job failed in the round's store
(:meth:`ElasticZeroAgent.announce_failure`) and, after closing, waits a few seconds at most for the other nodes to
see it — it may be the node hosting the embedded store.
"""

from __future__ import annotations

import os
from importlib import metadata

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import _get_addr_and_port
from torch.distributed.run import run_script_path
from torch.numa.binding import AffinityMode, NumaOptions

from elasticzero.agent.agent import ElasticZeroAgent, PeerFailedError
from elasticzero.agent.agentdirs import make_private, remove_if_empty, sweep
from elasticzero.agent.peers import bound_store_calls, state_read_period_s
from elasticzero.agent.plan import AgentPlan, LogsPlan, RendezvousPlan
from elasticzero.agent.prompt import make_prompt
from elasticzero.agent.stopsignals import StopSignals
from elasticzero.errors import UsageError

#: torchrun's entry-point group for ``--logs-specs NAME``
LOGS_SPECS_GROUP = "torchrun.logs_specs"


def logs_specs_class(name: str | None) -> type[LogsSpecs]:
    """The ``LogsSpecs`` class ``--logs-specs`` names (torchrun's entry-point lookup); torch's default for None."""
    if name is None:
        return DefaultLogsSpecs
    found = metadata.entry_points(group=LOGS_SPECS_GROUP, name=name)
    if not found:
        raise UsageError(f"--logs-specs {name}: no entry point {name!r} in group {LOGS_SPECS_GROUP}")
    cls: type[LogsSpecs] = next(iter(found)).load()
    return cls


def build_logs_specs(logs: LogsPlan) -> LogsSpecs:
    """The ``LogsSpecs`` object (torch's ``DefaultLogsSpecs`` creates a ``--log-dir`` that does not exist; the agent's
    own folder is made here first, for its user alone)."""
    if logs.owned:
        make_private(logs.log_dir, fix="remove it, or give --log-dir")
    return logs_specs_class(logs.specs)(
        log_dir=logs.log_dir,
        redirects=Std.from_str(logs.redirects),
        tee=Std.from_str(logs.tee),
        local_ranks_filter=set(logs.local_ranks_filter) if logs.local_ranks_filter is not None else None,
    )


def rdzv_parameters(rdzv: RendezvousPlan) -> RendezvousParameters:
    """torch's parameters for the rendezvous handler (a fresh config dict: the plan's stays untouched)."""
    return RendezvousParameters(
        backend=rdzv.backend,
        endpoint=rdzv.endpoint,
        run_id=rdzv.run_id,
        min_nodes=rdzv.min_nodes,
        max_nodes=rdzv.max_nodes,
        local_addr=rdzv.local_addr,
        **rdzv.config,
    )


def worker_spec(plan: AgentPlan, handler: RendezvousHandler, params: RendezvousParameters) -> WorkerSpec:
    """torch's ``WorkerSpec`` for the plan's workers, with ``handler`` (built from ``params``) as their rendezvous."""
    workers = plan.workers
    master_addr, master_port = _get_addr_and_port(params)
    numa = None if workers.numa_binding is None else NumaOptions(affinity_mode=AffinityMode(workers.numa_binding))
    return WorkerSpec(
        role=workers.role,
        local_world_size=workers.nproc_per_node,
        entrypoint=workers.entrypoint if workers.entrypoint is not None else run_script_path,
        args=workers.args,
        rdzv_handler=handler,
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=plan.rdzv.local_addr,
        event_log_handler=plan.event_log_handler,
        numa_options=numa,
        duplicate_stdout_filters=list(workers.duplicate_stdout_filters),
        duplicate_stderr_filters=list(workers.duplicate_stderr_filters),
        virtual_local_rank=workers.virtual_local_rank,
    )


def apply_torch_knobs(plan: AgentPlan) -> None:
    """Set the agent process's torch knobs (:attr:`AgentPlan.torch_knobs`): torch reads them with ``os.getenv``.

    The one place the agent writes its own environment, as torch's ``launch_agent`` does for the signals: these are
    settings of torch's code in this process, not the workers' environment (that goes through the start hook).
    """
    for name, value in plan.torch_knobs.items():
        os.environ[name] = value


class CutOffError(RendezvousConnectionError):
    """This node was in a round when its rendezvous store stopped answering: its workers are stopped; it may join
    again (:mod:`elasticzero.agent.rejoin`)."""


#: The rendezvous handlers this process was cut off from, kept referenced until it exits — the one lifetime anchor of
#: the agent process. torch's keep-alive thread holds its handler only through a weak reference while it is not
#: calling it, and a strong one while it is (blocked in a store call on a store out of reach): a handler dropped by
#: everyone else is freed *in* that thread, whose timer's finalizer then joins the thread from itself ("Exception
#: ignored in … RuntimeError: cannot join current thread"); freed in the main thread, the join waits for that store
#: call (up to its 60 s timeout). Kept, it is never freed: torch's finalizers do not run after the interpreter's
#: exit hooks. Once this node is dropped from the rendezvous state its keep-alive writes nothing.
_ABANDONED: list[RendezvousHandler] = []


def rendezvous_handler(plan: AgentPlan, params: RendezvousParameters) -> RendezvousHandler:
    """The registry's handler for ``params``; under ``--live-recovery`` its re-formations prompt
    (:func:`~elasticzero.agent.prompt.make_prompt`: polled at the peer watch's read period)."""
    handler = rdzv_registry.get_rendezvous_handler(params)
    if plan.workers.live is not None and plan.peers is not None:
        make_prompt(handler, state_read_period_s(plan.peers, plan.monitor_interval))
    return handler


def launch(plan: AgentPlan, stop_signals: StopSignals | None = None) -> tuple[RunResult, ElasticZeroAgent]:
    """Rendezvous, run the workers under :class:`ElasticZeroAgent` until they finish; return the result.

    ``stop_signals``: the process's stop-signal handler (:mod:`~elasticzero.agent.stopsignals`), taken back from
    torch after every worker start.
    """
    logs_specs = build_logs_specs(plan.workers.logs)
    sweep(os.environ, plan.job_id)  # folders of this job's agents killed earlier on this node (a rejoin after one)
    apply_torch_knobs(plan)
    params = rdzv_parameters(plan.rdzv)
    handler = bound_store_calls(rendezvous_handler(plan, params), plan.peers)
    spec = worker_spec(plan, handler, params)
    agent = ElasticZeroAgent(
        spec,
        logs_specs,
        health_file=plan.health_file,
        min_nodes=plan.rdzv.min_nodes,
        monitor_hold_file=plan.monitor_hold_file,
        worker_env=plan.workers.worker_env,
        start_method=plan.workers.start_method,
        log_line_prefix_template=plan.workers.log_line_prefix_template,
        shutdown_timeout=plan.shutdown_timeout,
        hang=plan.workers.hang,
        peers=plan.peers,
        live=plan.workers.live,
        stop_signals=stop_signals,
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
    except (RendezvousConnectionError, DistError) as exc:
        # the store is out of reach (a c10d store lost to a frozen host: closing would hang; a node trying to
        # join again must never close the job's rendezvous for the others)
        close_rendezvous = False
        if agent.joined:
            _ABANDONED.append(spec.rdzv_handler)
            raise CutOffError(str(exc)) from exc
        raise
    finally:
        agent.remove_health_file()
        if plan.workers.logs.owned:
            remove_if_empty(plan.workers.logs.log_dir)  # what a worker wrote there stays for the user
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
        if failed:  # this node may host the store: stay until the others saw the failure (bounded)
            agent.await_peers_informed()
