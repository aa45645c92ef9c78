"""Summarise the benchmark's per-rank JSON results into rows, a markdown table and a ratios section."""

from __future__ import annotations

import statistics
from typing import Any

from _peers import COMM_GOAL, FORMULA

MiB = 2**20
OP_ABBREV = {"reduce_scatter": "RS", "all_gather": "AG", "all_reduce": "AR", "broadcast": "BC", "reduce": "R"}


def summarise(peer: str, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One row from every round's rank results: worst rank (and round) for memory and traffic; step times are the
    slower rank's per step, pooled over rounds."""
    good = [ranks for ranks in rounds if "skipped" not in ranks[0] and "error" not in ranks[0]]
    if not good:
        first = rounds[0][0]
        return {"peer": peer, "status": first.get("skipped") or first.get("error")}
    every = [r for ranks in good for r in ranks]
    first = every[0]
    psi, world = first["params"], first["world_size"]
    held_points = [(r["held_bytes"][p]["total"], r["held_bytes"][p], p) for r in every for p in r["held_bytes"]]
    held_total, held_split, held_at = max(held_points, key=lambda h: h[0])

    def slower_rank(key: str, phase: str | None = None) -> list[float]:
        out: list[float] = []
        for ranks in good:
            series = [r[key][phase] if phase else r[key] for r in ranks]
            out += [max(ts) for ts in zip(*series, strict=True)]
        return out

    per_step = slower_rank("step_times_s")
    cpu_steps = slower_rank("step_cpu_s") if all("step_cpu_s" in r for r in every) else []
    units = max(r["comm_paper_units_per_step"] for r in every)
    comm = first["comm_elements_per_step"]
    engine = first.get("engine_comm_elements_per_step")
    formula = FORMULA[peer](world)
    reports = [rep for r in every for rep in (r.get("engine_memory_report") or {}).values()]
    engine_mem = max((rep["total"] / psi for rep in reports), default=None)
    return {
        "peer": peer,
        "status": "ok",
        "params": psi,
        "world_size": world,
        "held_B_per_param": held_total / psi,
        "held_split_B_per_param": {k: v / psi for k, v in held_split.items() if k != "total"},
        "held_at": held_at,
        "formula_B_per_param": formula,
        "held_vs_formula": held_total / psi / formula,
        "engine_report_B_per_param": engine_mem,
        "comm_psi": units / psi,
        "comm_goal_psi": COMM_GOAL[peer],
        "comm_split_psi": {op: n / psi for op, n in comm.items() if n},
        "engine_comm_psi": None if engine is None else sum(engine.values()) / psi,
        "step_ms_median": 1000 * statistics.median(per_step),
        "step_ms_min": 1000 * min(per_step),
        "step_ms_max": 1000 * max(per_step),
        "phase_ms_median": {
            k: 1000 * statistics.median(slower_rank("phase_times_s", k)) for k in ("forward", "backward", "step")
        },
        "cpu_ms_median": 1000 * statistics.median(cpu_steps) if cpu_steps else None,
        "timed_steps": len(per_step),
        "rounds_ok": f"{len(good)}/{len(rounds)}",
        "peak_rss_MiB": max(r["vmhwm_kib"] for r in every) / 1024,
        "peak_device_GiB": _peak_device_gib(every),
        "start_rss_MiB": max(r["rss_start_kib"] for r in every) / 1024,
        "final_loss": statistics.fmean(r["losses"][-1] for r in good[0]),
    }


def _peak_device_gib(ranks: list[dict[str, Any]]) -> float | None:
    """The largest rank's ``torch.cuda.max_memory_allocated`` over the timed steps, GiB (None on CPU)."""
    peaks = [r.get("peak_device_bytes") for r in ranks]
    return None if None in peaks else max(peaks) / 2**30  # type: ignore[type-var]


def _split(d: dict[str, float], abbrev: dict[str, str] | None = None) -> str:
    return " + ".join(f"{(abbrev or {}).get(k, k)} {v:.2f}" for k, v in d.items() if v >= 0.005) or "-"


COLUMNS = (
    "peer",
    "held B/param",
    "formula",
    "x formula",
    "held split (params+grads+state+other)",
    "engine report B/param",
    "comm Ψ/step",
    "goal",
    "comm split",
    "engine counter Ψ",
    "step ms median [min-max]",
    "fwd / bwd / step ms",
    "CPU ms/step",
    "peak RSS MiB",
    "final loss",
)


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _cells(r: dict[str, Any]) -> list[str]:
    if r["status"] != "ok":
        return [r["peer"], f"skipped: {r['status']}"] + [""] * (len(COLUMNS) - 2)
    split = r["held_split_B_per_param"]
    return [
        r["peer"],
        f"{r['held_B_per_param']:.3f}",
        f"{r['formula_B_per_param']:g}",
        f"{r['held_vs_formula']:.3f}",
        "+".join(f"{split[k]:.2f}" for k in ("params", "grads", "state", "other")),
        _opt(r["engine_report_B_per_param"], ".3f"),
        f"{r['comm_psi']:.4f}",
        str(r["comm_goal_psi"]),
        _split(r["comm_split_psi"], OP_ABBREV),
        _opt(r["engine_comm_psi"], ".4f"),
        f"{r['step_ms_median']:.0f} [{r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}]",
        " / ".join(f"{v:.0f}" for v in r["phase_ms_median"].values()),
        _opt(r["cpu_ms_median"], ".0f"),
        f"{r['peak_rss_MiB']:.0f}",
        f"{r['final_loss']:.4f}",
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table (one row per peer; skipped peers say why)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def _ratio(rows: dict[str, dict[str, Any]], a: str, b: str, key: str) -> float | None:
    if rows.get(a, {}).get(key) is not None and rows.get(b, {}).get(key) is not None:
        return rows[a][key] / rows[b][key]
    return None


def ratios(rows_list: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The goals of issues 4 and 23 as measured ratios (markdown lines, and the same as data)."""
    rows = {r["peer"]: r for r in rows_list}
    checks: list[tuple[str, float | None, float, str]] = []  # label, measured, goal, comparison
    for s in (1, 2, 3):
        peer = f"ez_stage{s}"
        r = rows.get(peer, {})
        ok = r.get("status") == "ok"
        checks.append((f"{peer} held bytes / ZeRO formula", r["held_vs_formula"] if ok else None, 1.02, "<="))
        checks.append((f"{peer} comm / ({COMM_GOAL[peer]}Ψ)", r["comm_psi"] / COMM_GOAL[peer] if ok else None, 1, "=="))
    time, cpu = "step_ms_median", "cpu_ms_median"
    for s in (1, 2):  # issue 23: at or below DDP (issue 4 allowed 1.05)
        checks.append((f"ez_stage{s} step time / ddp", _ratio(rows, f"ez_stage{s}", "ddp", time), 1.0, "<="))
        checks.append((f"ez_stage{s} step CPU time / ddp", _ratio(rows, f"ez_stage{s}", "ddp", cpu), 1.0, "<="))
    checks.append(("ez_stage3 step time / fsdp2", _ratio(rows, "ez_stage3", "fsdp2", time), 1.0, "<="))
    checks.append(("ez_stage3 step CPU time / fsdp2", _ratio(rows, "ez_stage3", "fsdp2", cpu), 1.0, "<="))
    checks.append(("ez_stage3 step time / fsdp2_keep", _ratio(rows, "ez_stage3", "fsdp2_keep", time), 1, "<="))
    for s in (1, 2, 3):
        checks.append((f"ez_stage{s} peak RSS / fsdp2", _ratio(rows, f"ez_stage{s}", "fsdp2", "peak_rss_MiB"), 1, "<="))
    for s in (1, 2, 3):
        peer, ds = f"ez_stage{s}", f"ds_stage{s}"
        checks.append((f"{peer} step time / {ds}", _ratio(rows, peer, ds, "step_ms_median"), 1, "<="))
        checks.append((f"{peer} peak RSS / {ds}", _ratio(rows, peer, ds, "peak_rss_MiB"), 1, "<="))
    for peer in ("fsdp2", "ez_stage1", "ez_stage2", "ez_stage3"):  # what per-block compile buys each peer
        checks.append((f"{peer}_compiled step time / {peer}", _ratio(rows, f"{peer}_compiled", peer, time), 1, "<="))
    for s in (1, 2, 3):  # compiled side by side: every stage against FSDP2, both per-block compiled
        peer = f"ez_stage{s}_compiled"
        checks.append((f"{peer} step time / fsdp2_compiled", _ratio(rows, peer, "fsdp2_compiled", time), 1, "<="))
        checks.append((f"{peer} step CPU time / fsdp2_compiled", _ratio(rows, peer, "fsdp2_compiled", cpu), 1, "<="))
    checks.append(("torch_zero1 comm / (3Ψ)", rows.get("torch_zero1", {}).get("comm_psi", 0) / 3 or None, 1, "=="))
    lines, data = [], {}
    for label, value, goal, cmp in checks:
        if value is None:
            verdict, shown = "not measured (peer skipped or failed, or value not recorded)", "-"
        else:
            met = abs(value - goal) < 1e-9 if cmp == "==" else value <= goal
            verdict, shown = ("met" if met else "MISSED"), f"{value:.4f}"
        lines.append(f"- {label}: {shown} (goal {cmp} {goal:g}) — {verdict}")
        data[label] = {"value": value, "goal": goal, "cmp": cmp}
    return "\n".join(lines), data
