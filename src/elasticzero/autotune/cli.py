"""``elasticzero-autotune`` and ``elasticzero-launch --autotuning tune|run``.

::

    elasticzero-autotune [launcher flags] [--tuning FILE] [--results-dir DIR] [--fresh] [--run] SCRIPT --config C …

The launcher flags are ``elasticzero-launch``'s (the pool comes from its discovery and filters). The tuning block is
``autotuning:`` in the config file the script gets (``--config`` by default; ``--deepspeed_config`` is found too),
or ``--tuning FILE``. :func:`prepare` checks everything and decides the whole search before anything starts;
bad input is one line and exit code 2. ``--run`` (``--autotuning run``) then launches the script with the best
config, autotuning off.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticzero.autotune.autotuner import Autotuner, Setup, TuningResult
from elasticzero.autotune.dialect import apply_point, base_of, check_expressible, is_deepspeed, split_tuning
from elasticzero.autotune.experiment import find_flag
from elasticzero.autotune.resources import ResourceManager
from elasticzero.autotune.runner import TrialLauncher, ssh_argv
from elasticzero.autotune.space import Point, TuningSpec, expand, parse_tuning
from elasticzero.autotune.tuners import Candidate
from elasticzero.errors import UsageError, cli_main

__all__ = ["main", "prepare", "run_from_launch"]

PROG = "elasticzero-autotune"
CONFIG_FLAGS = ("--config", "--deepspeed_config", "--deepspeed-config")
DEFAULT_BASE_PORT = 29500

#: launcher flags (dest, flag, kind) passed on to every experiment's elasticzero-launch
PASSTHROUGH = (
    ("launcher", "--launcher", "value"),
    ("launcher_args", "--launcher-args", "value"),
    ("launcher_opt", "--launcher-opt", "list"),
    ("ssh_port", "--ssh-port", "value"),
    ("no_ssh_check", "--no-ssh-check", "flag"),
    ("force_multi", "--force-multi", "flag"),
    ("per_rank", "--per-rank", "flag"),
    ("export", "--export", "list"),
    ("export_prefix", "--export-prefix", "list"),
    ("rdzv_backend", "--rdzv-backend", "value"),
    ("rdzv_conf", "--rdzv-conf", "value"),
    ("monitor_interval", "--monitor-interval", "value"),
    ("redirects", "--redirects", "value"),
    ("tee", "--tee", "value"),
    ("bind_cores_to_rank", "--bind-cores-to-rank", "flag"),
    ("module", "--module", "flag"),
    ("no_python", "--no-python", "flag"),
)
#: launcher flags that make no sense for a tuner that starts its own experiments, with the fix
REFUSED = {
    "no_ssh": "--no-ssh: the tuner starts every experiment itself; drop it",
    "node_rank": "--node-rank: the tuner starts every experiment itself; drop it",
    "save_pid": "--save-pid is not supported with autotuning",
    "nnodes": "--nnodes: experiments are not elastic; set autotuning.nodes instead",
    "rdzv_id": "--job-id: every experiment gets its own job id",
    "master_addr": "--master-addr: each experiment's rendezvous runs on its reservation's first host",
    "rdzv_endpoint": "--rdzv-endpoint: each experiment's rendezvous runs on its reservation's first host",
    "log_dir": "--log-dir: per-rank logs go to each experiment's ranks/ directory",
}


def add_tuning_flags(parser: argparse.ArgumentParser) -> None:
    """``elasticzero-autotune``'s own flag, on top of the launcher's (whose autotuning flags it shares)."""
    g = parser.add_argument_group("autotuning")
    g.add_argument("--run", action="store_true", help="after tuning, train with the best config (autotuning off)")


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    from elasticzero.launch.args import build_parser, split_entry

    parser = build_parser(PROG, f"{PROG} [launcher flags] [autotuning flags] SCRIPT [SCRIPT_ARGS…]")
    add_tuning_flags(parser)
    flags, entry = split_entry(parser, argv)
    return parser.parse_args(flags), entry


def passthrough(args: argparse.Namespace) -> list[str]:
    """The user's launcher flags every experiment (and the final run) gets, rebuilt from the parsed flags."""
    out: list[str] = []
    for dest, flag, kind in PASSTHROUGH:
        value = getattr(args, dest, None)
        if kind == "flag" and value:
            out.append(flag)
        elif kind == "list":
            for v in value or ():
                out += [flag, v]
        elif kind == "value" and value not in (None, ""):
            out.append(f"{flag}={value}")
    return out


def _refuse(args: argparse.Namespace) -> None:
    for dest, why in REFUSED.items():
        if getattr(args, dest, None) not in (None, False):  # a bare --save-pid is ""
            raise UsageError(why)


def _config_flag(entry: Sequence[str], named: str | None) -> tuple[str, str]:
    flags = (named,) if named else CONFIG_FLAGS
    for flag in flags:
        path = find_flag(entry[1:], flag)
        if path is not None:
            return flag, path
    raise UsageError(
        f"the script arguments have no {' / '.join(flags)} FILE: autotuning writes each trial's config there; "
        "pass the config file to the script, or name its flag with --config-flag"
    )


def prepare(args: argparse.Namespace, entry: Sequence[str], env: Mapping[str, str], cwd: str) -> Setup:
    """Check everything and decide the search (pure apart from reading the config and discovering the pool)."""
    from elasticzero.launch.resources import select_pool

    if not entry:
        raise UsageError(f"missing training script; usage: {PROG} [flags] SCRIPT [ARGS…]")
    _refuse(args)
    flag, config_file, config, spec = _inputs(args, entry, cwd)
    deepspeed = is_deepspeed(config)
    check_expressible(spec, deepspeed, str(config_file))
    manager = ResourceManager.from_pool(select_pool(args, env), spec.share_hosts)
    request = manager.default_request(spec.nodes, spec.slots_per_node)
    manager.check(request)
    world = request.nodes * request.slots_per_node
    base = base_of(config, deepspeed, world, str(config_file))
    points, skipped = expand(spec, base, world)
    setup = Setup(
        spec=spec,
        points=points,
        skipped=skipped,
        base_config=config,
        deepspeed=deepspeed,
        config_suffix=".yaml" if config_file.suffix.lower() in (".yaml", ".yml") else ".json",
        entry=tuple(entry),
        config_flag=flag,
        request=request,
        manager=manager,
        launch_flags=passthrough(args),
        base_port=args.master_port or DEFAULT_BASE_PORT,
        results_dir=Path(cwd, getattr(args, "results_dir", None) or spec.results_dir),
        train_batch_size=spec.train_batch_size or base.train_batch_size or base.micro_batch * base.accumulation * world,
        fresh=bool(getattr(args, "fresh", False)),
        retry_failed=bool(getattr(args, "retry_failed", False)),
    )
    setup.invalid = invalid_points(setup, world, str(config_file))
    if len(setup.invalid) == len(points):
        raise UsageError(
            f"every point of the search space gives an invalid config: {next(iter(setup.invalid.values()))}"
        )
    first = next(p for p in setup.points if p not in setup.invalid)
    setup.experiment(Candidate(first, spec.measure_steps))  # arg_mappings must resolve before anything starts
    return setup


def _inputs(args: argparse.Namespace, entry: Sequence[str], cwd: str) -> tuple[str, Path, dict[str, Any], TuningSpec]:
    """The config flag, the config file, the config without its tuning block, and the checked tuning block."""
    from elasticzero.config.load import read_file

    flag, config_path = _config_flag(entry, getattr(args, "config_flag", None))
    config_file = Path(cwd, config_path)
    config, block = split_tuning(read_file(config_file))
    where = f"{config_path}: autotuning"
    if getattr(args, "tuning", None):
        block, where = read_file(Path(cwd, args.tuning)), args.tuning
    return flag, config_file, config, parse_tuning(block, where)


def invalid_points(setup: Setup, world: int, source: str) -> dict[Point, str]:
    """Points whose trial config the engine's loader rejects — only when the user's own config loads cleanly
    (a config for another framework is not the engine's to judge)."""
    from elasticzero.config.load import load_config

    def problem(config: Mapping[str, Any]) -> str | None:
        try:
            with warnings.catch_warnings():  # DeepSpeed keys the engine drops: the script's business, not ours
                warnings.simplefilter("ignore")
                load_config(dict(config), world_size=world, strict=False)
        except UsageError as exc:
            return str(exc)
        return None

    if problem(setup.base_config) is not None:
        return {}
    found = {}
    for p in setup.points:
        why = problem(apply_point(setup.base_config, p, setup.deepspeed, setup.train_batch_size))
        if why:
            found[p] = why.replace("<dict>", source)
    return found


def plan(setup: Setup) -> dict[str, Any]:
    """``--dry-run``: what the tuner would do, decided and checked; nothing is started or written."""
    from elasticzero.autotune.runner import launch_argv
    from elasticzero.autotune.schedule import decide

    spec, r = setup.spec, setup.request
    first = decide(
        [("first", r)], setup.manager, running=0, max_running=None, base_port=setup.base_port, port_counter=0,
        ports_in_use=(),
    )[0][0]  # fmt: skip
    directory = setup.results_dir / "exps" / "<experiment>"
    argv = launch_argv(sys.executable, directory, first.reservation, first.port, "<job id>", setup.launch_flags)
    return {
        "metric": spec.metric.name,
        "maximize": spec.metric.maximize,
        "tuner": spec.tuner,
        "train_batch_size": setup.train_batch_size,
        "nodes_per_experiment": r.nodes,
        "slots_per_node": r.slots_per_node,
        "pool": {n.host: len(n.slots) for n in setup.manager.nodes},
        "results_dir": str(setup.results_dir),
        "resume": not setup.fresh,
        "first_launch": [*argv, "--", *setup.entry],
        "points": [{"name": p.name, **p.values(), "invalid": setup.invalid.get(p)} for p in setup.points],
        "left_out": [{"name": name, "reason": why} for name, why in setup.skipped],
    }


def plan_lines(shown: Mapping[str, Any]) -> list[str]:
    """The :func:`plan` as text (``--dry-run``; ``--dry-run=json`` prints it as JSON)."""
    lines = [
        f"{PROG} plan (dry run; nothing started)",
        f"  metric {shown['metric']} ({'max' if shown['maximize'] else 'min'}imised), tuner {shown['tuner']}, "
        f"{len(shown['points'])} point(s) at global batch {shown['train_batch_size']}",
        f"  each experiment: {shown['nodes_per_experiment']} node(s) x {shown['slots_per_node']} slot(s); pool "
        + ", ".join(f"{host}:{n}" for host, n in shown["pool"].items()),
        f"  results: {shown['results_dir']} ({'resumes its journal' if shown['resume'] else 'fresh'})",
        f"  first experiment's launch: {shlex.join(shown['first_launch'])}",
    ]
    lines += [
        f"  point {p['name']}" + (f"  (invalid: {p['invalid']})" if p["invalid"] else "") for p in shown["points"]
    ]
    lines += [f"  left out {x['name']}: {x['reason']}" for x in shown["left_out"]]
    return lines


def tune(args: argparse.Namespace, entry: Sequence[str], run_after: bool) -> int:
    """Tune (and with ``run_after`` train with the best config); the exit code."""
    from elasticzero.autotune.output import summary_lines, write_outputs

    setup = prepare(args, entry, os.environ, os.getcwd())
    if getattr(args, "dry_run", None):
        shown = plan(setup)
        print(json.dumps(shown, indent=2) if args.dry_run == "json" else "\n".join(plan_lines(shown)))
        return 0
    setup.results_dir.mkdir(parents=True, exist_ok=True)
    for key, why in setup.spec.ignored:
        print(f"{PROG}: note: autotuning.{key} is ignored: {why}", file=sys.stderr)
    launcher = TrialLauncher(sys.executable, setup.launch_flags, os.getcwd(), os.environ, ssh_argv(args.ssh_port))
    result = Autotuner(setup, launcher).run()
    paths = write_outputs(setup, result, _final_flags(args))
    print("\n".join(summary_lines(setup, result)))
    return _after(setup, result, paths, args, run_after)


def _final_flags(args: argparse.Namespace) -> list[str]:
    """The launcher flags of the final run: the user's discovery flags plus the passed-on ones."""
    out = []
    for dest, flag in (("hostfile", "--hostfile"), ("include", "--include"), ("exclude", "--exclude")):
        if getattr(args, dest, None):
            out.append(f"{flag}={getattr(args, dest)}")
    for dest, flag in (
        ("num_nodes", "--num-nodes"),
        ("num_gpus", "--nproc-per-node"),
        ("master_port", "--master-port"),
    ):
        if getattr(args, dest, None):
            out.append(f"{flag}={getattr(args, dest)}")
    return [*out, *passthrough(args)]


def _after(
    setup: Setup, result: TuningResult, paths: dict[str, Path], args: argparse.Namespace, run_after: bool
) -> int:
    """Say where the best config is and how to run it; with ``run_after``, run it (autotuning off)."""
    if result.best is None:
        print(f"{PROG}: no experiment succeeded; see {setup.results_dir / 'summary.txt'}", file=sys.stderr)
        return 1
    print(f"{PROG}: best config: {paths.get('best_json', paths['best_yaml'])}")
    print(f"{PROG}: run it with: {paths['command'].read_text().strip()}")
    if "plot" not in paths:
        print(f"{PROG}: note: no plot (install matplotlib: pip install 'elasticzero[plot]')", file=sys.stderr)
    if not run_after:
        return 0
    from elasticzero.autotune.output import best_command

    config = paths.get("best_json", paths["best_yaml"])
    argv = best_command(setup, _final_flags(args), result.best[2].entry, config)[1:]
    print(f"{PROG}: training with the best config (autotuning off)", flush=True)
    return _become_launcher(argv)


def _become_launcher(argv: list[str]) -> int:
    """Replace this process by ``elasticzero-launch argv`` (``execv``: same pid, so signals reach the launch and its
    exit code is ours), started as the trials' launcher is (``python -m elasticzero.launch.cli``); 127 if it cannot.

    A process, not an in-process call: the final run is a launch like any trial's, with no tuner state in it.
    """
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, "-m", "elasticzero.launch.cli", *argv])
    except OSError as exc:
        print(f"{PROG}: cannot start the launcher {sys.executable!r}: {exc}", file=sys.stderr)
    return 127


def run_from_launch(args: argparse.Namespace, entry: Sequence[str], mode: str) -> int:
    """``elasticzero-launch --autotuning tune|run``: the launcher's parsed flags, the script, the mode."""
    for dest in ("tuning", "results_dir", "fresh", "retry_failed", "run", "config_flag"):
        setattr(args, dest, getattr(args, dest, None))
    return tune(args, entry, run_after=mode == "run")


def _run(argv: Sequence[str] | None) -> int:
    try:
        args, entry = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    return tune(args, entry, run_after=args.run)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``elasticzero-autotune``: the exit code (2 on bad input, nothing started)."""
    return cli_main(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
