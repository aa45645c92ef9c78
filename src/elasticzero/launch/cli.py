"""``elasticzero-launch``: discovery + filters + env rules → :class:`LaunchPlan` → bound once → dry-run or execute.

Flow: parse flags (:mod:`.args`) → the pool (:func:`.resources.select_pool`: discovery, then ``-i``/``-e`` and
``--num-nodes``/``--num-gpus``) → exported env (:mod:`.envexport`) → :class:`LaunchPlan` →
``backend.bind(plan)`` → :class:`BoundPlan` (options checked, commands built, once). ``--dry-run`` prints that
bound plan and starts nothing; otherwise ``backend.preflight(bound)`` and
``elasticzero.launch.execute.execute(bound, backend)`` run the very same commands; the exit code is execute's.

Backend options: each backend declares them (:attr:`~elasticzero.launch.backend.LauncherBackend.options`); the
flags of :data:`OPTION_FLAGS` and ``--launcher-opt KEY=VALUE`` set them, and ``bind`` checks them, so the bound
plan's ``options`` are typed and complete and a key the backend does not have is a :class:`UsageError`.

Planning is pure: nothing on disk or on any host changes before execution starts. A bare ``--save-pid`` stays
``""`` in the plan; the private default path (:func:`default_pid_file`) is made only when the plan is executed.

Two checks guard the plan as a whole: a plan that spans several nodes (or an elastic ``--nnodes MIN:MAX`` with
MAX > 1 on a multi-node backend) must not rendezvous on a loopback address (every node would host its own store),
and the default ``--save-pid`` path is never a predictable name in a shared directory (see :func:`default_pid_file`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from elasticzero.agent.handoff import check_live_recovery
from elasticzero.agent.liveness import parse_peer_timeout
from elasticzero.agent.rejoin import rejoin_plan
from elasticzero.errors import UsageError, cli_main
from elasticzero.launch import backend as backend_mod
from elasticzero.launch.args import PROG, parse_args
from elasticzero.launch.envexport import export_env
from elasticzero.launch.plan import MASK, AgentOptions, BoundPlan, LaunchPlan, NodeSpec, is_secret, mask_value
from elasticzero.launch.rdzv import JobShape, RendezvousFlags, RendezvousTarget, exported_password, rendezvous_target
from elasticzero.launch.resources import select_pool
from elasticzero.proc import check_job_id

_NNODES = re.compile(r"(\d+)(?::(\d+))?")
#: the pid file inside the private directory made when ``$XDG_RUNTIME_DIR`` is not usable
PID_FILE_NAME = "launcher.pid"
#: flags that set a backend option: flag → (option, its value from the parsed flags, or None when not given)
OPTION_FLAGS: dict[str, tuple[str, Callable[[argparse.Namespace], object]]] = {
    "--ssh-port": ("ssh_port", lambda a: a.ssh_port),
    "--no-ssh-check": ("ssh_check", lambda a: False if a.no_ssh_check else None),
    "--per-rank": ("per_rank", lambda a: True if a.per_rank else None),
    "--node-rank": ("node_rank", lambda a: a.node_rank),
    "--save-pid": ("save_pid", lambda a: a.save_pid),  # "" (bare flag): the default path, made at execution
    "--max-node-restarts": ("max_node_restarts", lambda a: a.max_node_restarts),
}
#: DeepSpeed's ssh flags: scripts pass them on every launch, so a backend without ssh ignores them (with a note)
#: instead of refusing the command, as ``deepspeed`` does on a single node
SSH_FLAGS = frozenset({"--ssh-port", "--no-ssh-check"})


def make_job_id() -> str:
    """A job id unique per launch: ``ez-<UTC timestamp>-<random hex>`` (rendezvous id, scope of kills)."""
    return f"ez-{time.strftime('%Y%m%d%H%M%S', time.gmtime())}-{os.urandom(4).hex()}"  # secrets' source, unloaded


def _nnodes(spec: str | None, n_nodes: int) -> str:
    if spec is None:
        return str(n_nodes)
    m = _NNODES.fullmatch(spec)
    if not m:
        raise UsageError(f"--nnodes {spec!r}: expected N or MIN:MAX, e.g. --nnodes 2:4")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if lo < 1 or hi < lo:
        raise UsageError(f"--nnodes {spec!r}: need 1 <= MIN <= MAX")
    if not lo <= n_nodes <= hi:
        raise UsageError(f"--nnodes {spec} contradicts the {n_nodes} node(s) selected; adjust --nnodes or the hosts")
    return spec


def _launcher_args(text: str) -> tuple[str, ...]:
    """``--launcher-args`` split with shell rules; unbalanced quotes are a :class:`UsageError`."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        raise UsageError(f"--launcher-args {text!r}: {exc}; balance the quotes") from None


def _check_elastic_config(path: str, nnodes: str, nodes: Sequence[NodeSpec]) -> None:
    """``--elastic-config``: every world size ``--nnodes`` allows has a batch plan (omegaconf only, no torch).

    World sizes are node counts x slots per node; hosts with different slot counts are each checked as if every
    node had that many (conservative: it may refuse a mix that would only ever run on valid world sizes).
    """
    from elasticzero.config.load import check_elastic_config

    lo, _, hi = nnodes.partition(":")
    for nproc in sorted({len(n.slots) for n in nodes}):
        check_elastic_config(path, int(lo), int(hi or lo), nproc)


def default_pid_file(env: Mapping[str, str]) -> str:
    """Where a bare ``--save-pid`` writes the launcher's pid: never a guessable name in a shared directory.

    ``$XDG_RUNTIME_DIR/elasticzero-<pid>.pid`` when ``XDG_RUNTIME_DIR`` is an absolute path to an existing
    directory (per-user, mode 0700), else ``launcher.pid`` in a fresh private directory made by
    :func:`tempfile.mkdtemp` (``elasticzero-XXXXXXXX``, mode 0700). The caller removes that directory at exit.
    """
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, f"elasticzero-{os.getpid()}.pid")
    import tempfile  # lazy: only a bare --save-pid without XDG_RUNTIME_DIR needs it

    return os.path.join(tempfile.mkdtemp(prefix="elasticzero-"), PID_FILE_NAME)


def _made_pid_dir(path: str) -> Path | None:
    """The private directory :func:`default_pid_file` made for ``path``, if it made one."""
    parent = Path(path).parent
    made = Path(path).name == PID_FILE_NAME and parent.name.startswith("elasticzero-")
    return parent if made else None


def _launcher_options(
    args: argparse.Namespace, cls: type[backend_mod.LauncherBackend]
) -> tuple[dict[str, object], dict[str, str]]:
    """The backend options the command line sets (flags, then ``--launcher-opt``) and the flag that set each.

    An ssh flag (:data:`SSH_FLAGS`) that ``cls`` has no option for is left out with a note on stderr.
    """
    given: dict[str, object] = {}
    sources: dict[str, str] = {}
    known = {o.name for o in cls.all_options()}
    for flag, (key, value_of) in OPTION_FLAGS.items():
        value = value_of(args)
        if value is None:
            continue
        if flag in SSH_FLAGS and key not in known:
            print(f"{PROG}: note: {flag} does not apply to launcher {cls.name!r} (no ssh); ignored", file=sys.stderr)
            continue
        given[key], sources[key] = value, flag
    for item in args.launcher_opt:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UsageError(f"--launcher-opt {item!r}: expected KEY=VALUE, e.g. --launcher-opt mpiexec=mpiexec")
        if key in sources:
            raise UsageError(f"--launcher-opt {key}=…: option {key!r} is already set by {sources[key]}; give it once")
        given[key], sources[key] = value, f"--launcher-opt {key}=…"
    return given, sources


def _launcher_name(args: argparse.Namespace, n_nodes: int) -> str:
    if args.no_ssh:
        if args.launcher and args.launcher.lower() != "no-ssh":
            raise UsageError(f"--no-ssh contradicts --launcher {args.launcher}; drop one of them")
        if args.node_rank is None:
            raise UsageError("--no-ssh needs --node-rank R (run the same command on every node with its rank)")
        if args.node_rank >= n_nodes:
            raise UsageError(f"--node-rank {args.node_rank} but the plan has {n_nodes} node(s) (ranks 0-{n_nodes - 1})")
        return "no-ssh"
    if args.node_rank is not None:
        raise UsageError("--node-rank only applies with --no-ssh")
    if args.launcher:
        name = args.launcher.lower()
        if name == "local" and n_nodes > 1:
            raise UsageError(
                f"--launcher local runs on this machine but {n_nodes} nodes are selected; use -i or --num-nodes 1"
            )
        return name
    return "pdsh" if n_nodes > 1 or args.force_multi else "local"


def build_plan(
    args: argparse.Namespace,
    entry: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    detect_gpus: Callable[[], int] | None = None,
) -> LaunchPlan:
    """The plan for parsed ``args`` and the user's ``entry``, bound to its backend (options checked and typed)."""
    return bind_plan(args, entry, env, cwd, detect_gpus)[0].plan


def bind_plan(
    args: argparse.Namespace,
    entry: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    detect_gpus: Callable[[], int] | None = None,
) -> tuple[BoundPlan, backend_mod.LauncherBackend]:
    """The plan bound to its backend, and the backend (the entry points are read once, the plan bound once)."""
    plan, cls, sources = _plan(args, entry, env, cwd, detect_gpus)
    backend = cls()
    return backend.bind(plan, sources), backend


def _plan(
    args: argparse.Namespace,
    entry: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    detect_gpus: Callable[[], int] | None,
) -> tuple[LaunchPlan, type[backend_mod.LauncherBackend], dict[str, str]]:
    """The unbound plan (options as the command line gives them), its backend class and the flag behind each option."""
    if not entry:
        raise UsageError(f"missing training script; usage: {PROG} [flags] SCRIPT [ARGS…]")
    if args.module and args.no_python:
        raise UsageError("--module and --no-python cannot be combined")
    if args.rdzv_id is not None:
        check_job_id(args.rdzv_id, "--rdzv-id")
    pool = select_pool(args, env, detect_gpus)
    nodes = tuple(NodeSpec(host, rank, slots) for rank, (host, slots) in enumerate(pool.items()))
    name = _launcher_name(args, len(nodes))
    nnodes = _nnodes(args.nnodes, len(nodes))
    rdzv = rendezvous_target(_rdzv_flags(args), JobShape(nodes[0].host, len(nodes), nnodes, name))
    if args.elastic_config is not None:
        _check_elastic_config(os.path.join(cwd, args.elastic_config), nnodes, nodes)
    home = Path(env["HOME"]) if env.get("HOME") else None
    exported = exported_password(rdzv, export_env(env, args.export, args.export_prefix, home=home, cwd=Path(cwd)), env)
    launcher_args = _launcher_args(args.launcher_args)
    cls = backend_mod.launcher_class(name)
    options, sources = _launcher_options(args, cls)
    plan = LaunchPlan(
        job_id=args.rdzv_id or make_job_id(),
        backend=name,
        nodes=nodes,
        master_addr=rdzv.master_addr,
        master_port=rdzv.master_port,
        entry=tuple(entry),
        cwd=cwd,
        agent=_agent_options(args, nnodes, cwd, rdzv),
        env=exported,
        launcher_args=launcher_args,
        options=options,
    )
    return plan, cls, sources


def _rdzv_flags(args: argparse.Namespace) -> RendezvousFlags:
    return RendezvousFlags(args.rdzv_backend, args.rdzv_endpoint, args.master_addr, args.master_port, args.rdzv_conf)


def _live_recovery(args: argparse.Namespace, rdzv_backend: str) -> bool:
    """``--live-recovery``, checked against the backend every agent will get (one line, nothing launched)."""
    if args.live_recovery:
        check_live_recovery(rdzv_backend)
    return bool(args.live_recovery)


def _agent_options(args: argparse.Namespace, nnodes: str, cwd: str, rdzv: RendezvousTarget) -> AgentOptions:
    return AgentOptions(
        nnodes=nnodes,
        rdzv_backend=rdzv.backend,
        rdzv_conf=rdzv.conf,
        rdzv_endpoint=rdzv.endpoint,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        peer_timeout=None if args.peer_timeout is None else parse_peer_timeout(args.peer_timeout),
        rejoin_timeout=None if args.rejoin_timeout is None else rejoin_plan(args.rejoin_timeout, {}).timeout_s,
        live_recovery=_live_recovery(args, rdzv.backend),
        log_dir=os.path.join(cwd, args.log_dir) if args.log_dir else None,
        redirects=args.redirects,
        tee=args.tee,
        bind_cores_to_rank=args.bind_cores_to_rank,
        module=args.module,
        no_python=args.no_python,
    )


def _shown(name: str, value: str) -> str:
    """``value`` as printed: masked when ``name`` looks secret, else shell-quoted."""
    return MASK if is_secret(name) else shlex.quote(value)


def render_plan(bound: BoundPlan) -> str:
    """The bound plan for people: hosts, slots, endpoint, exported env and options (secrets masked), commands.

    The commands are the bound ones, verbatim (shlex-quoted argv; no argv holds a secret value, ``bind`` sees to
    it), each with its own variables (secret ones masked).
    """
    plan = bound.plan
    lines = [
        f"{PROG} plan (dry run; nothing started)",
        f"  job id:    {plan.job_id}",
        f"  backend:   {plan.backend}",
        f"  world:     {plan.world_size} rank(s) on {len(plan.nodes)} node(s); nnodes {plan.agent.nnodes}",
        f"  endpoint:  {plan.rdzv_endpoint} (rdzv {plan.agent.rdzv_backend})",
        f"  cwd:       {shlex.quote(plan.cwd)}",
        f"  entry:     {shlex.join(plan.entry)}",
        "  nodes:",
    ]
    lines += [f"    {n.node_rank:>3}  {n.host}  slots {','.join(map(str, n.slots))}" for n in plan.nodes]
    opts = " ".join(f"{k}={mask_value(k, repr(v))}" for k, v in sorted(plan.options.items()))
    lines.append(f"  options:   {opts or '(none)'}")
    lines.append(f"  env ({len(plan.env)} exported):")
    lines += [f"    {k}={_shown(k, v)}" for k, v in sorted(plan.env.items())]
    lines.append("  commands:")
    for cmd in bound.commands:
        where = f" [{cmd.host}]" if cmd.host else ""
        extra = " ".join(f"{k}={_shown(k, v)}" for k, v in sorted(cmd.env.items()))
        lines.append(f"   {where} {extra + ' ' if extra else ''}{shlex.join(cmd.argv)}")
    return "\n".join(lines)


def _run(argv: Sequence[str] | None) -> int:
    try:
        args, entry = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.autotuning:
        raise UsageError(
            f"--autotuning {args.autotuning}: the tuner runs from the elasticzero-launch console script (python -m "
            "elasticzero.entry) or elasticzero-autotune; python -m elasticzero.launch.cli is the launcher alone"
        )
    return run(args, entry)


def run(args: argparse.Namespace, entry: Sequence[str]) -> int:
    """A parsed launch without ``--autotuning`` (:mod:`elasticzero.entry` hands that to the tuner): bind the plan,
    then print it (``--dry-run``) or execute it; the exit code."""
    bound, backend = bind_plan(args, entry, os.environ, os.getcwd())
    return _show(args, bound, backend) if args.dry_run else _execute(bound, backend)


def _show(args: argparse.Namespace, bound: BoundPlan, backend: backend_mod.LauncherBackend) -> int:
    """Print the bound plan (``--dry-run``): the commands a launch would run; nothing is created or started."""
    try:
        backend.check_available()
    except UsageError as exc:
        print(f"{PROG}: note: {exc} (a real launch would stop here)", file=sys.stderr)
    print(json.dumps(bound.to_json(), indent=2) if args.dry_run == "json" else render_plan(bound))
    return 0


def _execute(bound: BoundPlan, backend: backend_mod.LauncherBackend) -> int:
    """Check, preflight, then execute the bound plan (the default pid path is made only now); the exit code."""
    backend.check_available()
    backend.preflight(bound)
    from elasticzero.launch.execute import execute  # lazy: execution lives with the backends

    plan = bound.plan
    if plan.options.get("save_pid") != "":
        return int(execute(bound, backend, replace_process=True))  # local/no-ssh: this process becomes the agent
    path = default_pid_file(os.environ)  # execution starts here: the only place the default path is made
    pid_dir = _made_pid_dir(path)
    try:  # the launcher's own option: the commands stay the very ones bound (and a dry run prints)
        return int(execute(replace(bound, plan=replace(plan, options={**plan.options, "save_pid": path})), backend))
    finally:
        if pid_dir is not None:
            try:
                pid_dir.rmdir()  # empty once execute() removed the pid file; never recursive
            except OSError:
                pass


def main(argv: Sequence[str] | None = None) -> int:
    """The launcher alone (``python -m elasticzero.launch.cli``: the tuner's trials and final run); the console
    script ``elasticzero-launch`` is :func:`elasticzero.entry.launch`. Returns the exit code (2 on bad input)."""
    return cli_main(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
