"""``elasticzero-run``: torchrun's command line, run by :class:`~elasticzero.agent.agent.ElasticZeroAgent`.

Every torchrun flag works as in torchrun (torch's own parser and ``config_from_args`` are reused); the flags
added by :mod:`elasticzero.agent.options` bind the node to its slots from ``--node-table``. Also
``elasticzero-run --kill-job JOBID [--grace S]`` (first flag) to stop a job's processes on this host.

Exit status: 0 on success; 2 for bad input (one line on stderr, nothing started); the root-cause worker's exit
code (128+N when it died of signal N) when workers failed and restarts are exhausted; 128+N when the agent
itself was stopped by signal N; 1 when another node's workers failed (restarts exhausted) or for other agent
errors (rendezvous timeout/closed, …).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elasticzero.errors import UsageError, cli_main
from elasticzero.launch.execute import STOP_SIGNALS  # the launcher's and torch's stop signals
from elasticzero.proc import check_job_id, exit_status, signal_exit_code

PROG = "elasticzero-run"
logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus elasticzero-run's flags; argparse errors become :class:`UsageError`."""
    from torch.distributed.run import get_args_parser

    from elasticzero.agent.options import add_agent_flags

    parser = get_args_parser()
    parser.prog = PROG
    parser.description = "torchrun-compatible per-node agent of elasticzero (ElasticZeroAgent)."
    add_agent_flags(parser)

    def error(message: str) -> None:  # argparse's default prints usage and exits; we want one line + exit 2
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign,assignment]
    return parser


def _kill_job_argv(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0].split("=", 1)[0] in ("--kill-job", "--kill_job")


def run(argv: Sequence[str] | None, startup_handlers: Mapping[int, object] | None = None) -> int:
    """Parse, validate, then launch (or kill a job); see the module docstring for exit codes.

    ``startup_handlers`` (from :func:`exit_on_stop_signals`) are put back right before the launch.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if _kill_job_argv(argv):
        return _kill_job(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kill_job is not None:
        raise UsageError("--kill-job must be the first flag and cannot be combined with a training script")
    return _launch(args, startup_handlers or {})


def _kill_job(argv: list[str]) -> int:
    from elasticzero.agent.killjob import main as kill_main

    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("--kill-job", "--kill_job", required=True, metavar="JOBID")
    parser.add_argument("--grace", type=float, default=5.0)
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # type: ignore[method-assign]
    ns = parser.parse_args(argv)
    if ns.grace < 0:
        raise UsageError(f"--grace {ns.grace:g}: must be >= 0 seconds")
    return kill_main(check_job_id(ns.kill_job, "--kill-job"), ns.grace)


def _launch(args: argparse.Namespace, startup_handlers: Mapping[int, object]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import _parse_rendezvous_config, config_from_args

    from elasticzero.agent.agent import PeerFailedError
    from elasticzero.agent.binding import agent_env, package_root, shim_argv
    from elasticzero.agent.launch import launch
    from elasticzero.agent.options import rdzv_configs, resolve

    settings = resolve(args)
    _standalone(args)
    settings = dataclasses.replace(settings, job_id=check_job_id(args.rdzv_id, "--rdzv-id"))  # --standalone picks it
    try:
        user_keys = set(_parse_rendezvous_config(args.rdzv_conf))
        config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError) as exc:
        raise UsageError(str(exc)) from None
    if args.elastic_config is not None:
        from elasticzero.config.load import check_elastic_config

        check_elastic_config(args.elastic_config, config.min_nodes, config.max_nodes, config.nproc_per_node)
    rdzv_configs(config.rdzv_configs, user_keys, settings, config.rdzv_backend, config.rdzv_endpoint)
    os.environ.update(agent_env(settings.job_id, settings.node.slots if settings.node else None, settings.cpus))
    # torch >= 2.4 lets workers reuse the rank-0 agent's rendezvous TCPStore, without a per-round key prefix: after
    # a restart the new workers read the dead workers' gloo/NCCL keys and hang. A fresh store per round avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    entrypoint: Callable[..., Any] | str
    if callable(cmd):
        entrypoint, entry_args = cmd, cmd_args
    else:
        entrypoint, entry_args = shim_argv(sys.executable, cmd, cmd_args, package_root())
    restore_handlers(startup_handlers)  # from the rendezvous on, torch's signal rules (as for torchrun)
    try:
        result, agent = launch(config, entrypoint, entry_args, health_file=settings.health_file)
    except SignalException as exc:
        print(f"{PROG}: stopped by {exc.sigval.name}", file=sys.stderr)
        return signal_exit_code(exc.sigval)
    except PeerFailedError as exc:
        print(f"{PROG}: job failed on another node: {exc}", file=sys.stderr)
        return 1
    except RendezvousError as exc:
        print(f"{PROG}: rendezvous failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if result is None or not result.is_failed():
        return 0
    return _failed_exit(result, agent)


def _failed_exit(result: object, agent: object) -> int:
    """Exit code from the root-cause failure; copy its error file to ours like torch's ``@record`` does."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from elasticzero.agent.agent import describe_failure, root_cause

    rank, failure = root_cause(result.failures)  # type: ignore[attr-defined]
    print(f"{PROG}: workers failed, restarts exhausted; {describe_failure(rank, failure)}", file=sys.stderr)
    if os.path.isfile(failure.error_file) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        get_error_handler().dump_error_file(failure.error_file, failure.exitcode)
    code = failure.exitcode
    return exit_status(code) or 1


def _standalone(args: argparse.Namespace) -> None:
    """torchrun's ``--standalone`` and single-node shortcuts (from ``torch.distributed.run.run``)."""
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if args.nnodes.split(":")[-1] == "1":
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def exit_on_stop_signals() -> dict[int, object]:
    """Until the launch starts, a stop signal ends the process with ``128+signal`` (no traceback, nothing running).

    Start-up (torch's import, parsing) takes seconds, and ``elasticzero-launch`` execs the agent for the ``local``
    and ``no-ssh`` backends, so a Ctrl-C or SIGTERM meant for the launcher may land here. Returns the previous
    handlers, which :func:`_launch` puts back before the rendezvous (from there torch's rules apply).
    """

    def stop(signum: int, _frame: object) -> None:
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
    """Console-script entry point of ``elasticzero-run``."""
    startup = exit_on_stop_signals()
    try:
        logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING").upper())
        return cli_main(PROG, lambda a: run(a, startup), argv)
    finally:
        restore_handlers(startup)  # called in-process (tests, tools): leave the caller's handlers as they were


if __name__ == "__main__":
    sys.exit(main())
