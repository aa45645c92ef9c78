"""Side-by-side ZeRO engine benchmark: elasticzero stages vs DDP, torch ZeRO-1, FSDP2 and DeepSpeed, on CPU or GPUs.

One driver invocation runs every peer in turn, each in fresh rank processes on 127.0.0.1 (gloo; NCCL with ``--device
cuda``, rank r on GPU r, where the DeepSpeed peers, CPU-only here, are left out), then prints
a markdown table and the goal ratios of issue 4 and saves everything (per-rank raw data included) as JSON under
``bench/results/``. Every number comes from that run; see ``bench/README.md`` for what each column measures.

    .venv/bin/python bench/engine_bench.py            # full run (~30M-param GPT)
    .venv/bin/python bench/engine_bench.py --quick    # ~1 minute smoke run (~4M params, fewer steps)
    .venv/bin/python bench/engine_bench.py --model llama --peers ddp,fsdp2,ez_stage1,ez_stage2,ez_stage3
    python bench/engine_bench.py --device cuda --precision bf16 --world-size 8 --size gpt350m --seq-len 1024
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
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from _peers import ALL_PEERS, PEERS  # noqa: E402
from _report import ratios, summarise, table  # noqa: E402
from ez_ports import free_port  # noqa: E402 (tests/ on sys.path: the one free-port rule of tests and benchmarks)

DEFAULT_DS_VENV = Path(os.environ.get("EZ_DS_VENV", "/work/ds-venv"))


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
    args = p.parse_args(argv)
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
    unknown = set(args.peers.split(",")) - set(ALL_PEERS)
    if unknown:
        p.error(f"unknown peers: {', '.join(sorted(unknown))}")
    return args


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


def main(argv: list[str] | None = None) -> int:
    """Run every requested peer sequentially, print the table and ratios, save JSON."""
    args = parse_args(argv)
    if args.report:
        return report(args.report)
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
