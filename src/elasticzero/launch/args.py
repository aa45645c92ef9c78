"""The ``elasticzero-launch`` command line: flags (torchrun dash style + DeepSpeed underscore spellings).

The launcher's own flags end at the first argument that is not a flag (the training script) or at ``--``;
everything after that belongs to the user's script and is passed on untouched, even when it looks like one of our
flags. :func:`parse_args` returns the parsed flags and that entry (script + its arguments).

Flags whose value is optional follow one fixed rule each, so a flag never silently swallows the script:

* ``--dry-run`` takes ``text`` or ``json`` either attached (``--dry-run=json``) or as the next argument
  (``--dry-run json``); only those two exact words are taken, anything else starts the entry.
* ``--save-pid`` takes a path only attached (``--save-pid=PATH``); a bare ``--save-pid`` uses the default path and
  the next argument is the script. A next argument ending in ``.pid`` is an error (it would run the pid file as
  the script); write ``--save-pid=PATH``, or ``--save-pid -- NAME.pid`` for a script really named like that.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from elasticzero.errors import UsageError

PROG = "elasticzero-launch"
DEFAULT_MASTER_PORT = 29500

#: DeepSpeed flags without an elasticzero equivalent, with what to do instead
UNSUPPORTED = {
    "--elastic_training": "use --nnodes MIN:MAX for an elastic job",
    "--min_elastic_nodes": "use --nnodes MIN:MAX for an elastic job",
    "--max_elastic_nodes": "use --nnodes MIN:MAX for an elastic job",
    "--bind_core_list": "use --bind-cores-to-rank (cores are split evenly between local ranks)",
    "--comment": "pass Slurm options through --launcher-args",
    "--account": "pass Slurm options through --launcher-args",
    "--venv_script": "activate the environment in the remote shell's startup file, or --export PATH",
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`UsageError` instead of exiting; ``--help`` lists backend options."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}; see {self.prog} --help")

    def format_help(self) -> str:
        """argparse's help, then each installed backend's options (loaded only when help is shown)."""
        from elasticzero.launch.backend import available_launchers, options_help

        return f"{super().format_help()}\n{options_help(available_launchers())}\n"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def _port(text: str) -> int:
    value = _nonneg_int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return value


def build_parser(prog: str = PROG, usage: str | None = None) -> argparse.ArgumentParser:
    """The flag parser (no positionals: the script is split off first, see :func:`split_entry`); ``prog`` names the
    console script in usage errors (``elasticzero-autotune`` reuses these flags)."""
    p = _Parser(
        prog=prog,
        usage=usage or f"{prog} [flags] SCRIPT [SCRIPT_ARGS…]",
        description="Launch a PyTorch job on the hosts of a hostfile, a Slurm allocation or this machine.",
        allow_abbrev=False,
    )
    r = p.add_argument_group("resources")
    r.add_argument(
        "-H", "--hostfile", metavar="PATH", help="hostfile with 'HOST slots=N' lines (default /job/hostfile)"
    )
    r.add_argument("-i", "--include", metavar="FILTER", help="keep only NODE[:SLOT,…][@NODE…]")
    r.add_argument("-e", "--exclude", metavar="FILTER", help="drop NODE[:SLOT,…][@NODE…]")
    r.add_argument("--num-nodes", "--num_nodes", type=_positive_int, metavar="N", help="use the first N hosts")
    r.add_argument(
        "--num-gpus",
        "--num_gpus",
        "--num-accelerators",
        "--num_accelerators",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="num_gpus",
        type=_positive_int,
        metavar="N",
        help="use the first N slots of each host (on a CPU-only localhost / Slurm allocation: start N processes)",
    )
    l_ = p.add_argument_group("launcher")
    l_.add_argument("--launcher", metavar="NAME", help="backend: pdsh (multi-node default), local (single node), …")
    l_.add_argument("--launcher-args", "--launcher_args", default="", metavar="ARGS", help="raw args for the backend")
    l_.add_argument(
        "--launcher-opt",
        "--launcher_opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a backend option (repeatable; the options of each backend are listed below)",
    )
    l_.add_argument("--ssh-port", "--ssh_port", type=_port, metavar="PORT", help="ssh port for pdsh/ssh")
    l_.add_argument("--no-ssh-check", "--no_ssh_check", action="store_true", help="skip the passwordless-ssh check")
    l_.add_argument("--no-ssh", "--no_ssh", action="store_true", help="per-node mode: run this on every node")
    l_.add_argument("--node-rank", "--node_rank", type=_nonneg_int, metavar="R", help="this node's rank (--no-ssh)")
    l_.add_argument("--force-multi", "--force_multi", action="store_true", help="multi-node backend for one node")
    l_.add_argument("--per-rank", "--per_rank", action="store_true", help="mpi/slurm start every rank directly")
    l_.add_argument(
        "--dry-run",
        "--dry_run",
        nargs="?",
        const="text",
        choices=["text", "json"],
        help="print the plan and start nothing: --dry-run [text|json] or --dry-run=json",
    )
    l_.add_argument(
        "--save-pid",
        "--save_pid",
        nargs="?",
        const="",
        metavar="PATH",
        help="write the launcher pid; a path only as --save-pid=PATH "
        "(default $XDG_RUNTIME_DIR/elasticzero-<pid>.pid, else a private temp dir)",
    )
    l_.add_argument(
        "--max-node-restarts",
        "--max_node_restarts",
        type=_nonneg_int,
        metavar="N",
        help="start a lost node's agent again (ssh died, agent killed), up to N times over the job (pdsh)",
    )
    l_.add_argument("--export", action="append", default=[], metavar="NAME", help="also export NAME (repeatable)")
    l_.add_argument("--export-prefix", "--export_prefix", action="append", default=[], metavar="P", help="prefix")
    a = p.add_argument_group("rendezvous and agent")
    a.add_argument("--master-addr", "--master_addr", metavar="ADDR", help="rendezvous host (default: first host)")
    a.add_argument("--master-port", "--master_port", type=_port, metavar="PORT", help="rendezvous port (29500)")
    a.add_argument("--nnodes", metavar="N|MIN:MAX", help="node count, or MIN:MAX for an elastic job")
    a.add_argument(
        "--elastic-config",
        "--elastic_config",
        metavar="FILE",
        help="elasticzero YAML / DeepSpeed JSON: refuse --nnodes allowing a world size with no batch plan",
    )
    a.add_argument("--rdzv-backend", "--rdzv_backend", metavar="NAME", help="rendezvous backend (elasticzero)")
    a.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        metavar="URL",
        help="the rendezvous store instead of --master-addr/--master-port: HOST:PORT (c10d) or "
        "etcd://H:P[,H:P…] / etcds://… (etcd v3; TLS and user in --rdzv-conf, the password from the environment)",
    )
    a.add_argument("--rdzv-conf", "--rdzv_conf", metavar="K=V,…", help="rendezvous configuration")
    a.add_argument("--rdzv-id", "--rdzv_id", "--job-id", "--job_id", dest="rdzv_id", metavar="ID", help="job id")
    a.add_argument("--max-restarts", "--max_restarts", type=_nonneg_int, default=0, metavar="N")
    a.add_argument("--monitor-interval", "--monitor_interval", type=float, metavar="SECONDS")
    a.add_argument(
        "--peer-timeout",
        "--peer_timeout",
        metavar="SECONDS",
        help="a node silent this long is gone; the others re-form without it (elasticzero-run --peer-timeout)",
    )
    a.add_argument(
        "--rejoin-timeout",
        "--rejoin_timeout",
        metavar="SECONDS",
        help="a node cut off from the rendezvous tries to join again this long (elasticzero-run --rejoin-timeout; "
        "default: the join timeout)",
    )
    a.add_argument(
        "--live-recovery",
        "--live_recovery",
        action="store_true",
        help="hand running workers the new round on a membership change instead of restarting them "
        "(elasticzero-run --live-recovery)",
    )
    a.add_argument("--log-dir", "--log_dir", "--enable_each_rank_log", dest="log_dir", metavar="DIR")
    a.add_argument("--redirects", metavar="SPEC", help="torchrun --redirects")
    a.add_argument("--tee", metavar="SPEC", help="torchrun --tee")
    a.add_argument("--bind-cores-to-rank", "--bind_cores_to_rank", action="store_true", help="pin cores per rank")
    a.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    a.add_argument(
        "--autotuning", choices=["tune", "run"], help="tune the ZeRO config first (run: then train with the best)"
    )
    a.add_argument("--tuning", metavar="FILE", help="autotuning: tuning block file (default: the config's)")
    a.add_argument("--results-dir", "--results_dir", metavar="DIR", help="autotuning: results (autotuning_results)")
    a.add_argument("--fresh", action="store_true", help="autotuning: start over instead of resuming")
    a.add_argument("--retry-failed", "--retry_failed", action="store_true", help="autotuning: re-run errors/timeouts")
    a.add_argument("--config-flag", "--config_flag", metavar="FLAG", help="autotuning: the script's config flag")
    a.add_argument("--no-python", "--no_python", action="store_true", help="SCRIPT is a program, not Python")
    a.add_argument(
        "--no-local-rank", "--no_local_rank", action="store_true", help="accepted; --local_rank is never passed"
    )
    return p


#: flags (dests) that only mean something with ``--autotuning`` (``elasticzero-autotune`` has them too)
AUTOTUNING_ONLY = ("tuning", "results_dir", "fresh", "retry_failed", "config_flag")

#: a separate argument after ``--save-pid`` with this ending is almost certainly the pid path, not the script
PID_SUFFIX = ".pid"


def _option_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string → its action."""
    table: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse has no public accessor for this
        for opt in action.option_strings:
            table[opt] = action
    return table


def _takes_next(action: argparse.Action, name: str, following: str | None) -> bool:
    """Whether the option ``name`` (given without ``=value``) takes ``following`` as its value.

    Options with a required value always take it; an optional value with fixed choices (``--dry-run json``) is
    taken only when ``following`` is exactly one of the choices; any other optional value (``--save-pid``) is
    never taken from a separate argument — see the module docstring.
    """
    if action.nargs is None:
        return True
    if action.nargs != "?" or following is None:
        return False
    if action.choices is not None:
        return following in action.choices
    if following.endswith(PID_SUFFIX) and action.dest == "save_pid":
        raise UsageError(
            f"{name} takes its path only as {name}=PATH: {following!r} would run as the training script; "
            f"write {name}={following} (or {name} -- {following} if that is the script)"
        )
    return False


def split_entry(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's flags and the entry (script + user arguments, untouched)."""
    table = _option_table(parser)
    argv = list(argv)
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i], argv[i + 1 :]
        if not tok.startswith("-") or tok == "-":
            return argv[:i], argv[i:]
        if tok.startswith("--"):
            name, eq, _ = tok.partition("=")
            attached = bool(eq)
        else:
            name, attached = tok[:2], len(tok) > 2
        if name not in table:
            hint = UNSUPPORTED.get(name)
            if hint:
                raise UsageError(f"{name} is not supported: {hint}")
            raise UsageError(f"unknown option {tok!r}; see {parser.prog} --help (script arguments go after the script)")
        following = argv[i + 1] if i + 1 < len(argv) else None
        i += 2 if not attached and _takes_next(table[name], name, following) else 1
    return argv, []


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parsed launcher flags and the entry (``[SCRIPT, ARG…]``; empty when no script was given)."""
    parser = build_parser()
    flags, entry = split_entry(parser, argv)
    args = parser.parse_args(flags)
    stray = [f"--{d.replace('_', '-')}" for d in AUTOTUNING_ONLY if getattr(args, d) and not args.autotuning]
    if stray:
        raise UsageError(f"{stray[0]} is an autotuning flag: add --autotuning tune|run (or use elasticzero-autotune)")
    return args, entry
