"""See elasticzero work on one GPU, in under 5 minutes: correctness, the example job, checkpoints, live recovery's
loop, speed and memory.

Six sections, each in processes of its own (one failing prints FAIL with its reason and the others still run):

1. correctness — ZeroStage1/2/3 at world size 1 over NCCL against ``torch.optim.AdamW`` on the same GPT and batches
   (``bench/_gpu_sections.py``): fp32 equal to the bit (stages 1/2) or within a derived fp32-rounding bound (stage 3),
   bf16 against autocast AdamW within a bound measured in the same run;
2. example — ``examples/train_gpt.py`` trained and checkpointed, resumed, and resumed again under
   ``elasticzero-launch --nproc-per-node 1``;
3. checkpoint — the ``Checkpointer``'s async save of a stage-2 and a stage-3 state on the GPU: the stall against a
   step, steps taken during the write, and a resume bit-exact with the parameters back on the GPU;
4. live — a world of one ``LiveTraining`` on the GPU over NCCL through two rounds (a round file the section writes,
   as the agent does): the group formed twice in one process (the old one aborted), the state carried bitwise into
   an optimizer built afresh, every step committed once. One GPU cannot run two NCCL ranks, so the buddy copies and
   the reshard's transfers between ranks are not run here;
5. offload — ZeRO-Offload at world size 1: ZeroStage1/2/3 with the optimizer (stage 3: and the parameters) in host
   memory against the same stage resident, fp32 by the ez_numerics rule with the step in backward; the state in
   host memory, page-locked, copied on a side stream; the peak device memory below the resident run's;
6. performance — a ~370M-parameter GPT (``--quick``: ~70M), bf16, batch 8 x 1024: median step time and peak
   ``torch.cuda.max_memory_allocated`` of fused AdamW, DDP, FSDP2 and ZeroStage1/2/3, as ratios to fused AdamW
   (``bench/engine_bench.py``'s rank worker at world size 1, every AdamW fused), then each stage's world-1 step-time
   and memory ratio on a line of its own; ``--profile-dir DIR`` adds a torch.profiler operator table
   (``DIR/<peer>.rank0.txt``, by device time) and a Chrome trace per peer.

Prints a compact report and writes it as JSON (``--out``); exits 1 if a correctness section (1-5) failed.

    python bench/gpu_check.py                      # on GPU 0
    python bench/gpu_check.py --quick              # smaller model, fewer steps
    python bench/gpu_check.py --device cpu --quick # the script's own logic on the CPU (gloo); no GPU figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

import torch  # noqa: E402

from _report import summarise  # noqa: E402
from engine_bench import parse_args as bench_args  # noqa: E402
from engine_bench import run_peer  # noqa: E402
from ez_ports import free_port  # noqa: E402 (tests/ on sys.path: the one free-port rule of tests and benchmarks)

PERF_PEERS = ("adamw", "ddp", "fsdp2", "ez_stage1", "ez_stage2", "ez_stage3")
CORRECTNESS = ("correctness", "example", "checkpoint", "live", "offload")
SECTIONS = (*CORRECTNESS, "performance")
BUDGET_S = 300.0  # the whole GPU run (issue 22: under 5 minutes on one H100)


@dataclass(frozen=True)
class Plan:
    """Sizes, step counts and time limits of one run (by device and ``--quick``)."""

    size: str  # GPT size: examples/gpt.py's or bench/_peers.py's GPU_SIZES
    batch: int
    seq: int
    warmup: int
    steps: int
    section_timeout_s: float  # per child section, and per run of the example
    peer_timeout_s: float  # per performance peer


def plan_for(device: str, quick: bool) -> Plan:
    """Full GPU run: ~370M GPT, batch 8 x 1024, 3 warm-up + 10 timed steps (~2 of the 5 minutes for 6 peers)."""
    if device == "cuda":
        if quick:
            return Plan("gpt70m", 8, 512, 2, 5, 150, 120)
        return Plan("gpt350m", 8, 1024, 3, 10, 150, 150)
    if quick:
        return Plan("tiny", 2, 32, 1, 2, 180, 120)
    return Plan("small", 4, 64, 2, 4, 300, 300)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda (GPU 0, NCCL) or cpu (gloo)")
    p.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list from: {', '.join(SECTIONS)}")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default bench/results/gpu_check-<utc>.json)")
    p.add_argument("--profile-dir", type=Path, default=None, help="torch.profiler table + trace per performance peer")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda}); "
            "check the driver and CUDA_VISIBLE_DEVICES, or run --device cpu to check this script's logic only"
        )
    return args


# -- processes ---------------------------------------------------------------------------------------------------------
def run_logged(argv: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``argv`` (its own session) with output to ``log``; (exit code, the log's text). On timeout its whole
    process group (the launcher's agent and workers included) is killed and the code is -9."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = -9
    return code, log.read_text(errors="replace")


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def child_section(name: str, device: str, quick: bool, workdir: Path, plan: Plan) -> dict[str, Any]:
    """Run one section of ``_gpu_sections.py`` in a fresh process; its JSON, or an ``error`` naming why not."""
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    out.unlink(missing_ok=True)  # a report left by an earlier run with the same --out must not pass for this one
    argv = [sys.executable, str(HERE / "_gpu_sections.py"), name, "--device", device, "--out", str(out)]
    code, text = run_logged([*argv, *(["--quick"] if quick else [])], log, plan.section_timeout_s)
    if code == -9:
        return {"error": f"timed out after {plan.section_timeout_s:.0f} s (log: {log})"}
    if not out.exists():
        return {"error": f"exited {code}: {last_line(text)} (log: {log})"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# -- example -----------------------------------------------------------------------------------------------------------
def example_section(device: str, quick: bool, workdir: Path, plan: Plan) -> dict[str, Any]:
    """``examples/train_gpt.py`` trains 4 steps saving every 2, resumes to 8 (both run directly: a world of one),
    then resumes to 10 under ``elasticzero-launch --nproc-per-node 1``; each run must exit 0, say where it resumed
    and commit its last checkpoint."""
    ckpt = workdir / "example-ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)  # the first run must start from nothing (an earlier run's, same --out)
    common = ["--size", "tiny", "--seq-len", "64", "--save-every", "2", "--async-save", "--checkpoint-dir", str(ckpt)]
    common += ["--corpus-bytes", str(1 << 20), "--cache-dir", str(workdir / "corpus-cache")]
    example = str(REPO / "examples" / "train_gpt.py")
    launch = [sys.executable, "-m", "elasticzero.launch.cli", "--nproc-per-node", "1", "--master-port"]
    runs = [
        ("direct: train 4 steps, save", [sys.executable, example, "--steps", "4"], 0, 4),
        ("direct: resume, train to 8", [sys.executable, example, "--steps", "8"], 4, 8),
        (
            "elasticzero-launch --nproc-per-node 1: resume, train to 10",
            [*launch, str(free_port()), example, "--steps", "10"],
            8,
            10,
        ),
    ]
    # the launcher starts `elasticzero-run` by name: this interpreter's scripts first on PATH (a new env, not ours)
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    checks, data = [], {}
    for i, (name, argv, resumed, final) in enumerate(runs):
        t0 = time.monotonic()
        code, text = run_logged([*argv, *common], workdir / f"example{i}.log", plan.section_timeout_s, env)
        data[name] = {"exit": code, "seconds": time.monotonic() - t0, "device_printed": device_printed(text)}
        checks.append(example_check(name, code, text, (resumed, newest_checkpoint(ckpt), final), device))
    return {"checks": checks, "data": data}


def newest_checkpoint(directory: Path) -> int | None:
    """The newest committed step in ``directory`` (the Checkpointer's own listing rule), None if there is none."""
    from elasticzero.checkpoint.commit import latest_step, list_dir

    return latest_step(list_dir(directory)) if directory.is_dir() else None


def device_printed(text: str) -> str | None:
    """The device the example says it trains on (its start-up line: ``train_gpt: ... on cuda:0 ...``), if named."""
    found = re.search(r"train_gpt: .* on ([a-z]+(?::\d+)?) ", text)
    return found.group(1) if found else None


def example_check(name: str, code: int, text: str, steps: tuple[int, int | None, int], device: str) -> dict[str, Any]:
    """One run of the example: exit 0, on ``device`` (its type), resumed at the expected step, its last step the
    newest checkpoint. ``steps``: (resumed at, wanted), newest committed, (wanted newest)."""
    resumed, newest, final = steps
    found = re.search(r"resumed at step (\d+)", text)
    at, on = (int(found.group(1)) if found else None), device_printed(text)
    ok = code == 0 and at == resumed and newest == final and (on or "").split(":")[0] == device.split(":")[0]
    if code != 0:
        detail = f"exited {code}: {last_line(text)}"
    else:
        detail = f"resumed at step {at} (want {resumed}); newest checkpoint step {newest} (want {final})"
        detail += f"; trains on {on or 'an unnamed device'} (want {device})"
    return {"name": f"example {name}", "ok": ok, "detail": detail}


# -- performance -------------------------------------------------------------------------------------------------------
def performance_section(device: str, plan: Plan, workdir: Path, profile_dir: Path | None) -> dict[str, Any]:
    """Every peer of :data:`PERF_PEERS` in fresh processes at world size 1 (bf16); rows and ratios to ``adamw``."""
    flags = ["--peers", ",".join(PERF_PEERS), "--size", plan.size, "--batch-size", str(plan.batch)]
    flags += ["--seq-len", str(plan.seq), "--warmup", str(plan.warmup), "--steps", str(plan.steps)]
    flags += ["--comm-steps", "1", "--world-size", "1", "--device", device, "--precision", "bf16", "--adamw", "fused"]
    flags += ["--timeout", str(plan.peer_timeout_s), *(["--profile-dir", str(profile_dir)] if profile_dir else [])]
    args = bench_args(flags)
    rows = {}
    for peer in PERF_PEERS:
        t0 = time.monotonic()
        rows[peer] = {**summarise(peer, [run_peer(peer, args, workdir)]), "wall_s": time.monotonic() - t0}
    failed = [f"{p}: {r['status']}" for p, r in rows.items() if r["status"] != "ok"]
    return {"rows": rows, "ratios": ratios(rows, device), "failed": failed, "plan": asdict(plan)}


def ratios(rows: dict[str, dict[str, Any]], device: str) -> dict[str, dict[str, float | None]]:
    """Each peer's median step time and peak memory divided by fused AdamW's (GPU memory on CUDA, RSS on CPU)."""
    memory = "peak_device_GiB" if device == "cuda" else "peak_rss_MiB"
    base = rows.get("adamw", {})

    def over(row: dict[str, Any], key: str) -> float | None:
        ok = row.get("status") == "ok" and base.get("status") == "ok"
        return row[key] / base[key] if ok and row.get(key) and base.get(key) else None

    return {p: {"step": over(r, "step_ms_median"), "memory": over(r, memory)} for p, r in rows.items()}


# -- report ------------------------------------------------------------------------------------------------------------
def status_of(name: str, result: dict[str, Any]) -> str:
    """PASS / FAIL for a correctness section, DONE / FAIL for the measurement."""
    if "error" in result or result.get("failed") or not all(c["ok"] for c in result.get("checks", [])):
        return "FAIL"
    return "PASS" if name in CORRECTNESS else "DONE"


def header(device: str, quick: bool) -> str:
    """Where it runs, said plainly (the GPU's details come with the correctness section, from its process)."""
    if device == "cpu":
        where = "device=cpu (gloo): RUNS ON THE CPU — a check of this script's logic; no figure below is a GPU figure"
    else:
        where = "device=cuda (GPU 0, NCCL), world size 1"
    return f"gpu_check: torch {torch.__version__}, python {platform.python_version()}, {where}" + (
        ", --quick" if quick else ""
    )


def environment_line(env: dict[str, Any]) -> str:
    """What the section's process saw: the GPU, CUDA, NCCL (or just the backend on the CPU)."""
    if "gpu" not in env:
        return f"  ran on {env.get('device', '?')} ({env.get('backend', '?')}), torch {env.get('torch', '?')}"
    return (
        f"  ran on {env['gpu']} ({env['gpu_memory_GiB']:.0f} GiB, capability {env['capability']}), "
        f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, backend {env['backend']}"
    )


def perf_lines(result: dict[str, Any], device: str) -> list[str]:
    """The side-by-side table of the performance section."""
    plan = result["plan"]
    rows, ratio = result["rows"], result["ratios"]
    params = next((r["params"] for r in rows.values() if r.get("status") == "ok"), 0)
    mem_label = "peak GiB" if device == "cuda" else "peak RSS MiB"
    lines = [
        f"  GPT {plan['size']} ({params:,} params), bf16, batch {plan['batch']} x {plan['seq']}, "
        f"{plan['warmup']} warm-up + {plan['steps']} timed steps, world size 1",
        f"  {'peer':10s} {'step ms':>9s} {'x adamw':>8s} {mem_label:>13s} {'x adamw':>8s}  fwd / bwd / step ms",
    ]
    for peer, r in rows.items():
        if r["status"] != "ok":
            lines.append(f"  {peer:10s} FAIL: {r['status']}")
            continue
        mem = r["peak_device_GiB"] if device == "cuda" else r["peak_rss_MiB"]
        step_x, mem_x = (ratio[peer][k] for k in ("step", "memory"))
        phases = " / ".join(f"{v:.1f}" for v in r["phase_ms_median"].values())
        lines.append(f"  {peer:10s} {r['step_ms_median']:9.1f} {_x(step_x):>8s} {mem:13.2f} {_x(mem_x):>8s}  {phases}")
    return [*lines, *overhead_lines(ratio)]


def overhead_lines(ratio: dict[str, dict[str, float | None]]) -> list[str]:
    """The world-1 overhead of each ZeRO stage over fused AdamW, said in one line each way (issue 23's figure):
    at world size 1 there is nothing to communicate, so what a stage adds is the engine's own work."""
    stages = [p for p in ratio if p.startswith("ez_stage")]
    step = ", ".join(f"{p.removeprefix('ez_')} {_x(ratio[p]['step'])}x" for p in stages)
    memory = ", ".join(f"{p.removeprefix('ez_')} {_x(ratio[p]['memory'])}x" for p in stages)
    return [f"  world-1 step time / fused AdamW: {step}", f"  world-1 peak memory / fused AdamW: {memory}"]


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def section_lines(name: str, result: dict[str, Any], device: str) -> list[str]:
    status = status_of(name, result)
    error = f": {result['error']}" if "error" in result else ""
    lines = [f"[{status}] {name} ({result.get('seconds', 0):.1f} s){error}"]
    if "environment" in result:
        lines.append(environment_line(result["environment"]))
    lines += [f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}" for c in result.get("checks", [])]
    if name == "performance" and "rows" in result:
        lines += perf_lines(result, device)
    return lines


# -- main --------------------------------------------------------------------------------------------------------------
def run_section(name: str, args: argparse.Namespace, workdir: Path, plan: Plan) -> dict[str, Any]:
    """One section; an exception of the driver itself becomes that section's error, never the script's end."""
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "correctness": lambda: child_section("correctness", args.device, args.quick, workdir, plan),
        "checkpoint": lambda: child_section("checkpoint", args.device, args.quick, workdir, plan),
        "live": lambda: child_section("live", args.device, args.quick, workdir, plan),
        "offload": lambda: child_section("offload", args.device, args.quick, workdir, plan),
        "example": lambda: example_section(args.device, args.quick, workdir, plan),
        "performance": lambda: performance_section(args.device, plan, workdir, args.profile_dir),
    }
    t0 = time.monotonic()
    try:
        result = runners[name]()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return {**result, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(timezone.utc)
    out = args.out or HERE / "results" / f"gpu_check-{started:%Y%m%dT%H%M%SZ}.json"
    workdir = out.with_suffix("")  # logs, per-rank JSON and checkpoints beside the report
    workdir.mkdir(parents=True, exist_ok=True)
    plan = plan_for(args.device, args.quick)
    results: dict[str, dict[str, Any]] = {}
    print(header(args.device, args.quick), flush=True)
    for name in args.sections.split(","):
        results[name] = run_section(name, args, workdir, plan)
        try:
            print("\n".join(section_lines(name, results[name], args.device)), flush=True)
        except Exception as exc:  # a report line that cannot be formatted must not lose the JSON report
            print(f"[{status_of(name, results[name])}] {name}: (could not format: {type(exc).__name__}: {exc})")
    failed = [n for n in CORRECTNESS if n in results and status_of(n, results[n]) == "FAIL"]
    total = (datetime.now(timezone.utc) - started).total_seconds()
    verdict = f"FAIL: {', '.join(failed)}" if failed else "PASS"
    budget = "" if args.device == "cpu" or total <= BUDGET_S else f" (over the {BUDGET_S:.0f} s budget)"
    print(f"\ngpu_check: {verdict} in {total:.0f} s{budget} on {args.device}; report {out}, logs {workdir}")
    doc = {
        "started_utc": started.isoformat(),
        "argv": sys.argv,
        "device": args.device,
        "ran_on_gpu": args.device == "cuda",
        "quick": args.quick,
        "torch": torch.__version__,
        "environment": results.get("correctness", {}).get("environment"),
        "plan": asdict(plan),
        "sections": {n: {"status": status_of(n, r), **r} for n, r in results.items()},
        "passed": not failed,
        "seconds": total,
        "budget_s": BUDGET_S,
    }
    out.write_text(json.dumps(doc, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
