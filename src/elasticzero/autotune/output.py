"""What a tuning run leaves behind: the summary table, ``results.csv``, the best config, the command, a plot.

``summary.txt`` (also printed): the best experiment per ZeRO stage, the overall best, every failure with its reason
and the points left out (pruned by an OOM, not expressible at the global batch, invalid config).
``best_config.yaml`` always; ``best_config.json`` too when the input was JSON/hjson (DeepSpeed JSON when the input
was DeepSpeed's). ``best_command.txt``: the exact ``elasticzero-launch`` command that trains with the best config
(autotuning off). ``results.csv``: one row per experiment. ``results.png``: the metric per experiment, when
matplotlib is installed (the ``plot`` extra); skipped with a note otherwise.
"""

from __future__ import annotations

import csv
import shlex
from collections.abc import Sequence
from pathlib import Path

from elasticzero.autotune.autotuner import Setup, TuningResult, dump_config
from elasticzero.autotune.experiment import with_flag
from elasticzero.autotune.outcome import Outcome
from elasticzero.autotune.tuners import Candidate, best, pruned_by_oom

__all__ = ["best_command", "summary_lines", "write_outputs"]


def summary_lines(setup: Setup, result: TuningResult) -> list[str]:
    """The summary table as lines (pure)."""
    metric = setup.spec.metric
    hist = [(c, o) for c, o, _ in result.history]
    lines = [
        f"autotuning: {len(hist)} experiment(s), tuner {setup.spec.tuner}, metric {metric.name} "
        f"({'max' if metric.maximize else 'min'}imised), {result.elapsed:.0f} s; stopped: {result.stopped_because}",
        f"{'experiment':<40} {'status':<8} {metric.name:>14} {'steps':>6} {'seconds':>8}",
    ]
    for stage in sorted({c.point.stage for c, _ in hist}):
        found = best([(c, o) for c, o in hist if c.point.stage == stage], metric)
        if found:
            lines.append(_row(f"best stage {stage}: {found[0].point.name}", metric.name, *found))
    if result.best:
        lines.append(_row(f"BEST: {result.best[0].point.name}", metric.name, *result.best[:2]))
    else:
        lines.append("BEST: none (no experiment succeeded)")
    for c, o in hist:
        if not o.ok:
            lines.append(f"failed {c.point.name} (steps {c.steps}): {o.status}: {o.reason}")
    for p, q in pruned_by_oom(setup.points, hist).items():
        if all(c.point != p for c, _ in hist):
            lines.append(f"pruned {p.name}: OOM at {q.name}")
    lines += [f"left out {name}: {why}" for name, why in setup.skipped]
    lines += [f"invalid {p.name}: {why}" for p, why in setup.invalid.items()]
    return lines


def _row(label: str, metric_name: str, cand: Candidate, outcome: Outcome) -> str:
    value = outcome.metrics.get(metric_name, float("nan"))
    return f"{label:<40} {outcome.status:<8} {value:>14.4g} {cand.steps:>6} {outcome.seconds:>8.1f}"


def best_command(setup: Setup, launch_argv: Sequence[str], entry: Sequence[str], config_path: Path) -> list[str]:
    """``elasticzero-launch`` + the user's launcher flags + the script with the best config (autotuning off)."""
    script, *args = entry
    return ["elasticzero-launch", *launch_argv, script, *with_flag(args, setup.config_flag, str(config_path))]


def write_outputs(setup: Setup, result: TuningResult, launch_argv: Sequence[str]) -> dict[str, Path]:
    """Write every output file into the results directory; returns name → path."""
    out = setup.results_dir
    paths: dict[str, Path] = {"summary": out / "summary.txt", "csv": out / "results.csv"}
    paths["summary"].write_text("\n".join(summary_lines(setup, result)) + "\n")
    _write_csv(paths["csv"], result)
    if result.best:
        paths.update(_write_best(setup, result, launch_argv))
    plot = _plot(out / "results.png", setup, result)
    if plot:
        paths["plot"] = plot
    return paths


def _write_best(setup: Setup, result: TuningResult, launch_argv: Sequence[str]) -> dict[str, Path]:
    assert result.best
    exp = result.best[2]
    out = setup.results_dir
    paths = {"best_yaml": out / "best_config.yaml"}
    paths["best_yaml"].write_text(dump_config(exp.config, ".yaml"))
    config_path = paths["best_yaml"]
    if setup.config_suffix != ".yaml":
        paths["best_json"] = config_path = out / "best_config.json"
        config_path.write_text(dump_config(exp.config, ".json"))
    command = best_command(setup, launch_argv, exp.entry, config_path)
    paths["command"] = out / "best_command.txt"
    paths["command"].write_text(shlex.join(command) + "\n")
    return paths


def _write_csv(path: Path, result: TuningResult) -> None:
    fixed = ["name", "key", "stage", "micro_batch", "accumulation", "steps", "status", "seconds"]
    keys = sorted({k for _, o, _ in result.history for k in o.metrics} - set(fixed))  # "steps" is the experiment's
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*fixed, *keys, "reason"])
        for c, o, e in result.history:
            p = c.point
            row = [e.name, e.key, p.stage, p.micro_batch, p.accumulation, c.steps, o.status, f"{o.seconds:.2f}"]
            w.writerow([*row, *(o.metrics.get(k, "") for k in keys), o.reason])


def _plot(path: Path, setup: Setup, result: TuningResult) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metric = setup.spec.metric
    rows = [(e.name, o.metrics[metric.name]) for _, o, e in result.history if o.ok and metric.name in o.metrics]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.4), 4))
    ax.bar(range(len(rows)), [v for _, v in rows])
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel(f"{metric.name} ({metric.unit})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
