"""Side-by-side ZeRO engine benchmark: elasticzero stages vs DDP, torch ZeRO-1, FSDP2 and DeepSpeed, on CPU or GPUs.

One driver invocation runs every peer in turn, each in fresh rank processes on 127.0.0.1 (gloo; NCCL with ``--device
cuda``, rank r on GPU r, where the DeepSpeed peers, CPU-only here, are left out), then prints
a markdown table and the goal ratios of issue 4 and saves everything (per-rank raw data included) as JSON under
``bench/results/``. Every number comes from that run; see ``bench/README.md`` for what each column measures.

    .venv/bin/python bench/engine_bench.py            # full run (~30M-param GPT)
    .venv/bin/python bench/engine_bench.py --quick    # ~1 minute smoke run (~4M params, fewer steps)
    .venv/bin/python bench/engine_bench.py --model llama --peers ddp,fsdp2,ez_stage1,ez_stage2,ez_stage3
    python bench/engine_bench.py --device cuda --precision bf16 --world-size 8 --size gpt350m --seq-len 1024
    python bench/engine_bench.py --largest --device cuda --seq-len 1024   # ZeRO-Offload against FSDP2's (one GPU)
    python bench/engine_bench.py --largest --dry-run                      # the plan only, anywhere

``--largest`` (GPU mode, world size 1, bf16): for each peer of :data:`LARGEST_PEERS` the GPT sizes of
``_peers.SEARCH_SIZES`` are tried smallest first until one does not train (out of memory, device or host: a larger one
would not either); it prints the largest model each trains, and on the largest model that both ``ez_stage3_offload``
and ``fsdp2_offload`` (FSDP2 with ``CPUOffloadPolicy``) train, the step-time ratio (issue 30's goal: at most 0.5x)
and the ratio of the largest models (goal: at least 1x).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "examples")]

from _peers import ALL_PEERS, GPU_SIZES, PEERS, SEARCH_SIZES  # noqa: E402
from _report import ratios, summarise, table  # noqa: E402
from ez_ports import free_port  # noqa: E402 (tests/ on sys.path: the one free-port rule of tests and benchmarks)
from gpt import SIZES  # noqa: E402

DEFAULT_DS_VENV = Path(os.environ.get("EZ_DS_VENV", "/work/ds-venv"))
LARGEST_PEERS = ("ez_stage3", "fsdp2", "ez_stage3_offload_opt", "ez_stage3_offload", "fsdp2_offload")
"""``--largest``'s peers: resident ZeRO-3 and FSDP2 (what fits without offload), then the offloading ones."""
HEAD_TO_HEAD = ("ez_stage3_offload", "fsdp2_offload")  # the same split: parameters, gradients and step on the host


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; ``--quick`` changes the defaults of size and step counts (explicit flags still win)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model (~4M), 1 warm-up + 3 timed steps")
    p.add_argument("--peers", default=None, help=f"comma list from: {', '.join(ALL_PEERS)} (default: all but adamw)")
    p.add_argument("--size", default=None, help="GPT size from examples/gpt.py (default bench; quick: small)")
    p.add_argument(
        "--model",
        default="gpt",
        choices=["gpt", "llama"],
        help="gpt: examples/gpt.py; llama: a ~31M-param Hugging Face Llama (GQA) from a config (needs transformers)",
    )
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 6; quick: 3)")
    p.add_argument("--comm-steps", type=int, default=None, help="counted steps (default 2; quick: 1)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient/gather bucket size for every peer")
    p.add_argument("--world-size", type=int, default=2, help="ranks per peer (default 2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: rank r on GPU r, NCCL")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: every peer's mixed precision")
    p.add_argument(
        "--adamw",
        default="fused",
        choices=["fused", "default"],
        help="fused: every peer's AdamW fused=True (default); default: none passed (torch's default for plain peers, "
        "the engine's fused default for the ZeRO stages)",
    )
    p.add_argument("--profile-dir", type=Path, default=None, help="each rank: torch.profiler over 2 extra steps here")
    p.add_argument("--rounds", type=int, default=None, help="run all peers this many times, order alternating (1)")
    p.add_argument("--ds-python", type=Path, default=DEFAULT_DS_VENV / "bin" / "python", help="DeepSpeed venv python")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per peer before its ranks are killed")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/engine_bench-<utc>.json)")
    p.add_argument("--report", type=Path, default=None, help="re-print table and ratios from a saved JSON (no run)")
    p.add_argument("--largest", action="store_true", help="GPU mode: largest GPT per peer at world 1, offload ratios")
    p.add_argument("--sizes", default=",".join(SEARCH_SIZES), help="--largest: GPT sizes to try, smallest first")
    p.add_argument("--dry-run", action="store_true", help="print what would run (peers, sizes, worker flags); run none")
    args = p.parse_args(argv)
    peers_given = args.peers is not None
    quick = {"size": "small", "warmup": 1, "steps": 3, "comm_steps": 1, "rounds": 1}
    full = {"size": "bench", "warmup": 2, "steps": 5, "comm_steps": 1, "rounds": 1}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    on_cpu_only = [peer for peer in PEERS if peer.startswith("ds_")]  # the DeepSpeed venv runs DS_ACCELERATOR=cpu
    if args.peers is None:
        args.peers = ",".join(peer for peer in PEERS if args.device == "cpu" or peer not in on_cpu_only)
    if args.device == "cuda" and set(args.peers.split(",")) & set(on_cpu_only):
        p.error(f"--device cuda: the DeepSpeed peers ({', '.join(on_cpu_only)}) run on the CPU only")
    if args.largest:
        largest_defaults(args, p, peers_given)
    unknown = set(args.peers.split(",")) - set(ALL_PEERS)
    if unknown:
        p.error(f"unknown peers: {', '.join(sorted(unknown))}")
    return args


def largest_defaults(args: argparse.Namespace, p: argparse.ArgumentParser, peers_given: bool) -> None:
    """``--largest``: world size 1, bf16, its peers unless ``--peers`` named others, at most 1 + 3 steps per size."""
    if args.world_size not in (1, 2):  # 2 is the default: left alone, it becomes 1
        p.error("--largest runs at world size 1 (one GPU)")
    args.world_size, args.precision = 1, "bf16"
    if not peers_given:
        args.peers = ",".join(LARGEST_PEERS)
    args.warmup, args.steps, args.comm_steps = min(args.warmup, 1), min(args.steps, 3), 1
    unknown = [s for s in args.sizes.split(",") if not known_size(s)]
    if unknown:
        p.error(f"--sizes: unknown GPT sizes {', '.join(unknown)}")


def known_size(size: str) -> bool:
    """A size ``_worker.model_config`` builds: examples/gpt.py's names or ``_peers.GPU_SIZES``."""
    return size in GPU_SIZES or size in SIZES


def run_peer(peer: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Start ``world_size`` rank processes for ``peer``, wait, and return their JSON results (or one error row)."""
    python = sys.executable
    if peer.startswith("ds_stage"):
        if not args.ds_python.exists():
            return [{"peer": peer, "skipped": f"no DeepSpeed venv at {args.ds_python} (bash bench/_ds_venv.sh)"}]
        python = str(args.ds_python)
    port = free_port()
    flags = [
        f"--peer={peer}",
        f"--size={args.size}",
        f"--model={args.model}",
        f"--batch-size={args.batch_size}",
        f"--seq-len={args.seq_len}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--comm-steps={args.comm_steps}",
        f"--bucket-mb={args.bucket_mb}",
        f"--device={args.device}",
        f"--precision={args.precision}",
        f"--adamw={args.adamw}",
        *([f"--profile-dir={args.profile_dir}"] if args.profile_dir else []),
    ]
    procs, outs, logs = [], [], []
    for rank in range(args.world_size):
        out, log = workdir / f"{peer}.rank{rank}.json", workdir / f"{peer}.rank{rank}.log"
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.world_size),
            "LOCAL_WORLD_SIZE": str(args.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONUNBUFFERED": "1",
        }
        with open(log, "w") as log_f:
            argv = [python, str(HERE / "_worker.py"), *flags, f"--out={out}"]
            procs.append(subprocess.Popen(argv, env=env, stdout=log_f, stderr=subprocess.STDOUT))
        outs.append(out)
        logs.append(log)
    deadline = time.monotonic() + args.timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)  # faulthandler: Python stacks into the rank's log
            time.sleep(2)
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            return [{"peer": peer, "error": f"timed out after {args.timeout:.0f}s (logs: {logs[0].parent})"}]
    results = []
    for proc, out, log in zip(procs, outs, logs, strict=True):
        if proc.returncode != 0 or not out.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            return [{"peer": peer, "error": f"rank exited {proc.returncode}: {tail[0][:200]} (log: {log})"}]
        results.append(json.loads(out.read_text()))
    return results


def git_head() -> str:
    """The commit the benchmark ran from (``unknown`` outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def report(path: Path) -> int:
    """Re-render the table and ratios from a saved run's raw per-rank data (measures nothing)."""
    doc = json.loads(path.read_text())
    raw = {peer: rounds if isinstance(rounds[0], list) else [rounds] for peer, rounds in doc["raw"].items()}
    rows = [summarise(peer, rounds) for peer, rounds in raw.items()]
    print(f"engine_bench report of the run started {doc['started_utc']} (git {doc.get('git_head', 'unknown')})")
    print(f"settings: {doc['settings']}\nloads: {doc['loads']}\n")
    print(table(rows) + "\n\nRatios (goals from issue 4):\n" + ratios(rows)[0])
    return 0


# -- --largest: the largest model per peer, and ZeRO-Offload against FSDP2's CPUOffloadPolicy -------------------------
def search_largest(peer: str, sizes: list[str], attempt: Any) -> dict[str, dict[str, Any]]:
    """``attempt(size)`` (a summarised row) for ``sizes`` smallest first, stopping after the first that did not
    train: a larger model of the same family does not fit where a smaller one did not."""
    rows: dict[str, dict[str, Any]] = {}
    for size in sizes:
        rows[size] = attempt(size)
        if rows[size]["status"] != "ok":
            break
    return rows


def largest_trained(rows: dict[str, dict[str, Any]]) -> str | None:
    """The largest size that trained (the last ``ok`` before the first failure, sizes in search order)."""
    trained = None
    for size, row in rows.items():
        if row["status"] != "ok":
            break
        trained = size
    return trained


def offload_verdict(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The figures of issue 30: per peer its largest model (size, parameters); on the largest size both
    :data:`HEAD_TO_HEAD` peers trained, each elasticzero offload peer's step time over ``fsdp2_offload``'s; the
    largest elasticzero offload model over FSDP2's in parameters."""
    largest = {p: largest_trained(rows) for p, rows in results.items()}
    params = {p: (results[p][s]["params"] if s else 0) for p, s in largest.items()}
    ez, fsdp = HEAD_TO_HEAD
    both = [s for s in results.get(ez, {}) if results.get(fsdp, {}).get(s, {}).get("status") == "ok"]
    common = next((s for s in reversed(both) if results[ez][s]["status"] == "ok"), None)
    step: dict[str, float | None] = {}
    for peer in results:
        if (
            peer.startswith("ez_")
            and "offload" in peer
            and common
            and results[peer].get(common, {}).get("status") == "ok"
        ):
            step[peer] = results[peer][common]["step_ms_median"] / results[fsdp][common]["step_ms_median"]
    model = params.get(ez, 0) / params[fsdp] if params.get(fsdp) else None
    return {"largest": largest, "params": params, "common_size": common, "step_ratio": step, "model_ratio": model}


def verdict_lines(verdict: dict[str, Any]) -> list[str]:
    """The verdict said plainly, goals included."""
    lines = [
        f"  {p:22s} largest: {s or 'none'} ({verdict['params'][p]:,} params)" for p, s in verdict["largest"].items()
    ]
    common = verdict["common_size"]
    for peer, ratio in verdict["step_ratio"].items():
        lines.append(f"  step time {peer} / fsdp2_offload on {common}: {ratio:.2f}x (goal <= 0.5x)")
    if not verdict["step_ratio"]:
        lines.append("  step time: no size that both ez_stage3_offload and fsdp2_offload trained")
    ratio = verdict["model_ratio"]
    lines.append(
        f"  largest model ez_stage3_offload / fsdp2_offload: {'-' if ratio is None else f'{ratio:.2f}'}x (goal >= 1x)"
    )
    return lines


def largest_main(args: argparse.Namespace) -> int:
    """``--largest``: the search for every peer, the verdict, the JSON (``--dry-run``: the plan only)."""
    sizes, peers = args.sizes.split(","), args.peers.split(",")
    print(
        f"engine_bench --largest: peers {', '.join(peers)}; sizes {', '.join(sizes)} (smallest first, until one fails)"
    )
    print(f"  world 1, {args.device}, bf16, batch {args.batch_size} x {args.seq_len}, {args.warmup}+{args.steps} steps")
    if args.dry_run:
        for peer in peers:
            print(f"  would run: _worker.py --peer={peer} --size=<each size> --device={args.device} --precision=bf16")
        return 0
    started = datetime.now(timezone.utc)
    out = args.out or HERE / "results" / f"engine_bench_largest-{started:%Y%m%dT%H%M%SZ}.json"
    workdir = out.with_suffix("")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for peer in peers:
        results[peer] = search_largest(peer, sizes, lambda size, peer=peer: attempt_size(peer, size, args, workdir))
    verdict = offload_verdict(results)
    print("\n".join(verdict_lines(verdict)))
    doc = {"started_utc": started.isoformat(), "argv": sys.argv, "git_head": git_head(), "results": results}
    out.write_text(
        json.dumps({**doc, "verdict": verdict, "settings": {k: str(v) for k, v in vars(args).items()}}, indent=1)
    )
    print(f"\nsaved {out}")
    return 0


def attempt_size(peer: str, size: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One run of ``peer`` on GPT ``size`` at world 1 (its own rank process); the summarised row, printed."""
    sized = argparse.Namespace(**{**vars(args), "size": size})
    (workdir / size).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    row = summarise(peer, [run_peer(peer, sized, workdir / size)])
    shown = f"{row['step_ms_median']:.0f} ms/step" if row["status"] == "ok" else row["status"][:160]
    print(f"  {peer:22s} {size:8s} {time.monotonic() - t0:6.1f}s  {shown}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    """Run every requested peer sequentially, print the table and ratios, save JSON."""
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    if args.largest:
        return largest_main(args)
    started = datetime.now(timezone.utc)
    out = args.out or HERE / "results" / f"engine_bench-{started:%Y%m%dT%H%M%SZ}.json"
    workdir = out.with_suffix("")  # per-rank JSON + logs beside the summary
    for rnd in range(args.rounds):
        (workdir / f"round{rnd}").mkdir(parents=True, exist_ok=True)
    print(
        f"engine_bench: {started:%Y-%m-%d %H:%M:%S} UTC  model={args.model} size={args.size} "
        f"batch={args.batch_size} seq={args.seq_len} "
        f"ranks={args.world_size} warmup={args.warmup} steps={args.steps} comm-steps={args.comm_steps} "
        f"rounds={args.rounds} adamw={args.adamw} "
        f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    peers = args.peers.split(",")
    raw: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in peers}
    loads: dict[str, list[dict[str, float]]] = {p: [] for p in peers}
    for rnd in range(args.rounds):
        order = peers if rnd % 2 == 0 else peers[::-1]  # alternate the order so load drift hits peers evenly
        for peer in order:
            t0, load0 = time.monotonic(), os.getloadavg()[0]
            results = run_peer(peer, args, workdir / f"round{rnd}")
            raw[peer].append(results)
            load = {"load_before": load0, "load_after": os.getloadavg()[0], "wall_s": time.monotonic() - t0}
            loads[peer].append(load)
            row = summarise(peer, [results])
            shown = f"{row['step_ms_median']:.0f} ms/step" if row["status"] == "ok" else row["status"]
            print(f"  [{rnd}] {peer:12s} {load['wall_s']:6.1f}s  load {load0:.2f}->{load['load_after']:.2f}  {shown}")
    rows = [summarise(peer, raw[peer]) for peer in peers]
    ratio_text, ratio_data = ratios(rows)
    print("\n" + table(rows) + "\n\nRatios (goals from issue 4):\n" + ratio_text)
    doc = {
        "started_utc": started.isoformat(),
        "argv": sys.argv,
        "git_head": git_head(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "loads": loads,
        "rows": rows,
        "ratios": ratio_data,
        "table_markdown": table(rows),
        "raw": raw,
    }
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nsaved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
