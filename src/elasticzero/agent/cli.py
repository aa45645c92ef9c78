"""``elasticzero-run``: torchrun's command line, run by :class:`~elasticzero.agent.agent.ElasticZeroAgent`.

Every torchrun flag works as in torchrun (torch's own parser is reused, and the plan follows torchrun's
``config_from_args``); the flags added by :mod:`elasticzero.agent.options` bind the node to its slots from
``--node-table``. The command line, the environment and what was probed on this machine become one frozen
:class:`~elasticzero.agent.plan.AgentPlan` before anything starts; ``--dry-run`` prints it. Also
``elasticzero-run --kill-job JOBID [--grace S] [--node-host HOST]`` (first flag) to stop a job's processes on this host
(only node HOST's, with ``--node-host``).

Exit status: 0 on success; 2 for bad input (one line on stderr, nothing started); the root-cause worker's exit
code (128+N when it died of signal N) when workers failed and restarts are exhausted; 128+N when the agent
itself was stopped by signal N; 1 when another node's workers failed (restarts exhausted) or for other agent
errors (rendezvous timeout/closed, …).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from elasticzero.errors import UsageError, cli_main
from elasticzero.proc import STOP_SIGNALS, check_job_id, exit_status, leave_if_threads_left, signal_exit_code

if TYPE_CHECKING:
    from elasticzero.agent.plan import AgentPlan
    from elasticzero.agent.stopsignals import StopSignals

PROG = "elasticzero-run"
logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus elasticzero-run's flags; argparse errors become :class:`UsageError`."""
    from elasticzero.agent.options import add_agent_flags
    from elasticzero.torchcompat import torchrun_parser

    parser = torchrun_parser()
    parser.prog = PROG
    parser.description = "torchrun-compatible per-node agent of elasticzero (ElasticZeroAgent)."
    add_agent_flags(parser)

    def error(message: str) -> None:  # argparse's default prints usage and exits; we want one line + exit 2
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign,assignment]
    return parser


def _kill_job_argv(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0].split("=", 1)[0] in ("--kill-job", "--kill_job")


def run(argv: Sequence[str] | None) -> int:
    """Parse, validate, then launch (or kill a job); see the module docstring for exit codes.

    From the launch on, :class:`~elasticzero.agent.stopsignals.StopSignals` handles the stop signals in place of
    :func:`exit_on_stop_signals`'s.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if _kill_job_argv(argv):
        return _kill_job(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kill_job is not None:
        raise UsageError("--kill-job must be the first flag and cannot be combined with a training script")
    return _launch(args)


def _kill_job(argv: list[str]) -> int:
    from elasticzero.agent.killjob import main as kill_main

    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("--kill-job", "--kill_job", required=True, metavar="JOBID")
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--node-host", "--node_host", default=None, metavar="HOST")
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # type: ignore[method-assign]
    ns = parser.parse_args(argv)
    if ns.grace < 0:
        raise UsageError(f"--grace {ns.grace:g}: must be >= 0 seconds")
    return kill_main(check_job_id(ns.kill_job, "--kill-job"), ns.grace, ns.node_host)


def _launch(args: argparse.Namespace) -> int:
    """Probe, plan (nothing started on bad input), check, then print the plan (``--dry-run``) or run it."""
    from elasticzero.agent.facts import probe_facts
    from elasticzero.agent.launch import logs_specs_class
    from elasticzero.agent.plan import plan_agent

    environ = dict(os.environ)
    plan = plan_agent(args, environ, probe_facts(args, environ))
    if plan.elastic_config is not None:
        from elasticzero.config.load import check_elastic_config

        rdzv = plan.rdzv
        check_elastic_config(plan.elastic_config, rdzv.min_nodes, rdzv.max_nodes, plan.workers.nproc_per_node)
    logs_specs_class(plan.workers.logs.specs)  # an unknown --logs-specs is bad input too
    if args.dry_run:
        print(plan.to_text())
        return 0
    from elasticzero.agent.stopsignals import StopSignals

    stop = StopSignals()  # from the rendezvous on: the first stop signal stops the run, none is raised twice
    stop.install()
    try:
        return _run(plan, stop)
    finally:
        stop.leave()  # a signal in the teardown (a finalizer) is noted, never raised: the run's code stands


def _run(plan: AgentPlan, stop: StopSignals) -> int:
    """Run the plan — again, as a new node, while it is cut off from its rendezvous (:mod:`~elasticzero.agent.rejoin`)
    — and return the exit status (module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        return _run_rejoining(plan, stop)
    except SignalException as exc:  # between two tries (a run's own stop is _once's)
        print(f"{PROG}: stopped by {exc.sigval.name}", file=sys.stderr)
        return signal_exit_code(exc.sigval)


def _run_rejoining(plan: AgentPlan, stop: StopSignals) -> int:
    """:func:`_once`, again while this node is cut off and its time to join again lasts."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from elasticzero.agent.launch import CutOffError
    from elasticzero.agent.rejoin import GiveUp, cut_off_line, next_try

    cut_at: float | None = None  #: when this node was last cut off (monotonic); None: never
    while True:
        try:
            return _once(plan, stop)
        except CutOffError as exc:
            print(f"{PROG}: {cut_off_line(str(exc), plan.rejoin)}", file=sys.stderr, flush=True)
            if plan.rejoin.timeout_s == 0:
                return 1
            cut_at = time.monotonic()
        except (RendezvousConnectionError, DistError) as exc:
            if cut_at is None:  # never in a round: the store is not there (a bad endpoint, nothing started yet)
                print(f"{PROG}: rendezvous failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
            step = next_try(plan.rejoin, time.monotonic() - cut_at, f"{type(exc).__name__}: {exc}")
            if isinstance(step, GiveUp):
                print(f"{PROG}: {step.line}", file=sys.stderr)
                return 1
            time.sleep(step.after_s)


def _once(plan: AgentPlan, stop: StopSignals) -> int:
    """One run of the agent (one rendezvous handler); its exit status, or a store out of reach raised."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError

    from elasticzero.agent.agent import PeerFailedError
    from elasticzero.agent.launch import launch

    try:
        result, _ = launch(plan, stop)
    except SignalException as exc:
        print(f"{PROG}: stopped by {exc.sigval.name}", file=sys.stderr)
        return signal_exit_code(exc.sigval)
    except PeerFailedError as exc:
        print(f"{PROG}: job failed on another node: {exc}", file=sys.stderr)
        return 1
    except RendezvousConnectionError:
        raise  # the caller decides: cut off (join again) or never reached
    except RendezvousError as exc:
        print(f"{PROG}: rendezvous failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if result is None or not result.is_failed():
        return 0
    return _failed_exit(result, plan.error_file)


def _failed_exit(result: object, error_file: str | None) -> int:
    """Exit code from the root-cause failure; copy its error file to ours (``error_file``) like torch's ``@record``."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from elasticzero.agent.agent import describe_failure, root_cause

    rank, failure = root_cause(result.failures)  # type: ignore[attr-defined]
    print(f"{PROG}: workers failed, restarts exhausted; {describe_failure(rank, failure)}", file=sys.stderr)
    if os.path.isfile(failure.error_file) and error_file:
        get_error_handler().dump_error_file(failure.error_file, failure.exitcode)
    code = failure.exitcode
    return exit_status(code) or 1


def exit_on_stop_signals(*, process: bool = False) -> dict[int, object]:
    """Until the launch starts, a stop signal ends the process with ``128+signal`` (no traceback, nothing running).

    Start-up (torch's import, parsing) takes seconds, and ``elasticzero-launch`` execs the agent for the ``local``
    and ``no-ssh`` backends, so a Ctrl-C or SIGTERM meant for the launcher may land here. Returns the previous
    handlers (:func:`main` puts them back for an in-process caller); from the launch on
    :class:`~elasticzero.agent.stopsignals.StopSignals` handles the signals.

    ``process``: this process is the agent (the console script), so the handler ends it with ``os._exit``. A raised
    ``SystemExit`` lands wherever the main thread is, and most of start-up is torch's import, partly run from C++
    (``torch._C``'s initialisation imports numpy, ``torch.distributed``'s runs Python): there it was swallowed —
    torch went on without a word, the agent started its workers and the stop was lost (a SIGHUP ~0.9 s after an
    unloaded ``elasticzero-launch --launcher local``: the job ran on) — or it broke numpy's import (a traceback
    and exit 1 later) or escaped a C++ frame (``std::terminate``, SIGABRT). Nothing runs yet and nothing is written
    before the launch, so there is nothing to clean up. An in-process caller (``process`` false) gets the
    ``SystemExit``: its process is not ours to end.
    """

    def stop(signum: int, _frame: object) -> None:
        if process:
            os._exit(signal_exit_code(signum))
        raise SystemExit(signal_exit_code(signum))

    if threading.current_thread() is not threading.main_thread():
        return {}  # only the main thread may set handlers
    previous: dict[int, object] = {int(s): signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        if previous[s] is not signal.SIG_IGN:  # nohup's ignored SIGHUP stays ignored
            signal.signal(s, stop)
    return previous


def restore_handlers(previous: Mapping[int, object]) -> None:
    """Put back what :func:`exit_on_stop_signals` replaced."""
    for s, handler in previous.items():
        if handler is not None:  # None: set outside Python, cannot be put back
            signal.signal(s, handler)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point of ``elasticzero-run``.

    Called with ``argv`` (in-process: tests, tools) it leaves the caller's signal handlers as they were. As the
    process's entry (``argv`` None) it keeps its own until the interpreter exits: the teardown after a run (the
    c10d store's destructor, seconds on the node hosting it) must neither raise a stop signal in a finalizer nor
    be killed by one at the default action with another exit code.
    """
    startup = exit_on_stop_signals(process=argv is None)
    try:
        logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING").upper())
        code = cli_main(PROG, run, argv)
    finally:
        if argv is not None:
            restore_handlers(startup)
    # a node cut off from its store left threads blocked in calls on it (an abandoned handler's keep-alive): a store
    # host ending with the job would return them into this interpreter's finalization (SIGABRT)
    return code if argv is not None else leave_if_threads_left(code)


if __name__ == "__main__":
    sys.exit(main())
