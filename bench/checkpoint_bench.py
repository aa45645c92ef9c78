"""Checkpoint benchmark: elasticzero's Checkpointer vs plain torch DCP on the same ZeRO state, on CPU.

One invocation starts 2 gloo ranks (this file with ``--worker``) training the ~29.5M-parameter GPT of
``examples/gpt.py`` under ``ZeroStage2`` (fp32 AdamW), and measures side by side, in the same processes:

1. save stall — how long ``save`` blocks the training loop: ``Checkpointer`` sync and async vs ``dcp.save`` and
   ``dcp.async_save`` of the same state dict (the same planner, so the same bytes), and vs one training step. The
   first save of each method (fresh staging buffers: page faults) is reported apart from the later ones;
2. step-time drag — every step taken while an async save is in flight vs steps taken just before that save (A B A B),
   wall and the training thread's CPU seconds, for the default ``SCHED_IDLE`` writer, ``writer_priority=19`` (the
   nicest niceness) and ``writer_priority=0``; ``--drag-repeats`` saves each;
3. load at a new world size — a fresh process (a restarted worker) loads the 2-rank checkpoint into ``ZeroStage3`` at
   world size 1, one process per load, the methods' order rotated per repeat:
   ``Checkpointer.load_latest`` (with and without checksum verification) vs ``dcp.load`` of the same template, vs the
   raw read time of the same files — through one reused buffer, and into one new buffer of their size (the page
   faults any first load in a process pays) — all of it with the files in the page cache (warm) and evicted first
   (cold: ``POSIX_FADV_DONTNEED``, what a node that did not write them sees).

Prints a table and the ratios of issue 8's goals, and the machine load. Not a test: timings, bounded by --timeout.

    .venv/bin/python bench/checkpoint_bench.py            # 29.5M GPT, 2 ranks
    .venv/bin/python bench/checkpoint_bench.py --size small --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ez_ports import free_port  # tests/ on sys.path: the one free-port rule of tests and benchmarks

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DS_PYTHON = Path(os.environ.get("EZ_DS_VENV", "/work/ds-venv")) / "bin" / "python"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="bench", help="GPT size from examples/gpt.py (default bench, ~29.5M)")
    p.add_argument("--batch-size", type=int, default=2, help="micro-batch per rank (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--steps", type=int, default=4, help="timed steps without a save running (default 4)")
    p.add_argument("--repeats", type=int, default=4, help="saves/loads timed per method (default 4; >= 2)")
    p.add_argument("--drag-repeats", type=int, default=8, help="async saves per writer priority (default 8)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint scratch directory (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--out", type=Path, default=None, help="also write the raw JSON here")
    p.add_argument("--ds-python", type=Path, default=DS_PYTHON, help="DeepSpeed venv python (bash bench/_ds_venv.sh)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed columns")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load-child", choices=LOADS, help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker (one rank) ------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, config_for, lm_loss, num_params, synthetic_batch  # noqa: I001 (examples/ on sys.path)
    from elasticzero.checkpoint import Checkpointer
    from elasticzero.checkpoint.planner import ZeroSavePlanner
    from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
    from elasticzero.engine.zero.stage2 import ZeroStage2

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = config_for(args.size, block_size=max(args.seq_len, config_for(args.size).block_size))
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroStage2(model, torch.optim.AdamW, lr=1e-4)
    torch.set_num_threads(1)
    x, y = synthetic_batch(cfg, args.batch_size, args.seq_len, torch.Generator().manual_seed(1 + rank))

    cpu_steps: list[float] = []

    def step() -> float:
        t0, c0 = time.perf_counter(), time.thread_time()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        cpu_steps.append(time.thread_time() - c0)
        return time.perf_counter() - t0

    step()
    base_steps = [step() for _ in range(args.steps)]
    root = Path(args.dir)
    ckpt_group = dist.new_group(backend="gloo")
    state = {"zero": ZeroCheckpointState(opt)}
    res: dict[str, Any] = {"params": num_params(model), "step_s": base_steps}

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    sync = Checkpointer(root / "ours_sync", keep_last=1, process_group=ckpt_group)
    res["ours_sync_stall_s"] = [timed(lambda i=i: sync.save(i, state)) for i in range(args.repeats)]
    res["dcp_save_stall_s"] = [
        timed(lambda i=i: dcp.save(opt_sd(state), checkpoint_id=root / f"dcp_{i}", planner=ZeroSavePlanner()))
        for i in range(args.repeats)
    ]

    for tag, priority in WRITERS:
        asyn = Checkpointer(
            root / f"ours_async{tag}", keep_last=1, async_save=True, process_group=ckpt_group, writer_priority=priority
        )
        res.update(_async_run(asyn, state, step, timed, cpu_steps, args, tag))
        asyn.close()

    dstalls = []
    for i in range(args.repeats):
        sd, cid = opt_sd(state), root / f"dcpa_{i}"
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=cid, planner=ZeroSavePlanner(), process_group=ckpt_group)
        dstalls.append(time.perf_counter() - t0)
        fut.result()
    res["dcp_async_stall_s"] = dstalls
    res["ckpt_bytes"] = sum(f.stat().st_size for f in (root / "ours_sync").rglob("*") if f.is_file())

    dist.barrier()
    dist.destroy_process_group()
    return res


WRITERS = (("", "idle"), ("_nice19", 19), ("_nice0", 0))  # (result key suffix, writer_priority)


# -- load at a new world size: one fresh process per load (what a restarted worker is) ---------------------------------
LOADS = ("raw_read", "raw_fresh", "load_dcp", "load_ours", "load_ours_nocrc")


def load_child(args: argparse.Namespace) -> float:
    """One measurement in this fresh process: a raw read, or a load of the 2-rank checkpoint in ``args.dir`` into a
    freshly built ``ZeroStage3`` at world size 1 (files evicted from the page cache first with ``--cold``)."""
    src = Path(args.dir)
    step_dir = next(p for p in src.iterdir() if p.name.startswith("step-") and p.is_dir())
    if args.load_child.startswith("raw"):
        if args.cold:
            _evict(step_dir)
        return (_raw_read if args.load_child == "raw_read" else _raw_read_fresh)(step_dir)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, config_for  # noqa: I001 (examples/ on sys.path)
    from elasticzero.checkpoint import Checkpointer
    from elasticzero.checkpoint.planner import SafeFileSystemReader, ZeroLoadPlanner
    from elasticzero.checkpoint.snapshot import fresh_like
    from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
    from elasticzero.engine.zero.stage3 import ZeroStage3

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    cfg = config_for(args.size, block_size=max(args.seq_len, config_for(args.size).block_size))
    torch.manual_seed(1)
    state = {"zero": ZeroCheckpointState(ZeroStage3(GPT(cfg), torch.optim.AdamW, lr=1e-4))}

    def dcp_load() -> None:
        template = {"zero": fresh_like(state["zero"].state_dict())}
        dcp.load(template, storage_reader=SafeFileSystemReader(step_dir), planner=ZeroLoadPlanner())

    load = {
        "load_dcp": dcp_load,
        "load_ours": lambda: Checkpointer(src, read_only=True).load_latest(state),
        "load_ours_nocrc": lambda: Checkpointer(src, verify_on_load=False, read_only=True).load_latest(state),
    }[args.load_child]
    if args.cold:
        _evict(step_dir)
    t0 = time.perf_counter()
    load()
    took = time.perf_counter() - t0
    dist.destroy_process_group()
    return took


def measure_loads(ckpt_dir: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Every load method and raw read in a fresh process each, warm and cold, the order rotated per repeat."""
    out: dict[str, list[float]] = {}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    for i in range(args.repeats):
        for cold in ("", "_cold"):
            for method in LOADS[i % len(LOADS) :] + LOADS[: i % len(LOADS)]:
                argv = [sys.executable, __file__, "--load-child", method, "--dir", str(ckpt_dir), "--size", args.size]
                argv += ["--seq-len", str(args.seq_len)] + (["--cold"] if cold else [])
                run_env = dict(env, MASTER_PORT=str(free_port()))
                done = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=args.timeout)
                if done.returncode != 0:
                    raise SystemExit(f"load child {method} failed:\n{done.stderr[-2000:]}")
                out.setdefault(f"{method}{cold}_s", []).append(float(done.stdout.split()[-1]))
    return out


def _async_run(asyn: Any, state: Any, step: Any, timed: Any, cpu: list[float], args: Any, tag: str) -> dict[str, Any]:
    """A B A B: ``args.steps`` steps with no save running, then an async save and every step while it is in flight
    (both ranks keep stepping until both saves committed: the steps stay collective)."""
    import torch
    import torch.distributed as dist

    out: dict[str, list[Any]] = {"ours_async_stall_s": [], "step_before_async_s": [], "step_during_async_s": []}
    out.update({"step_before_async_cpu_s": [], "step_during_async_cpu_s": [], "async_save_s": []})
    out["drag_per_save_s"] = []  # (median step during / median of the steps just before) - 1, per save
    out["drag_lost_per_save_s"] = []  # the steps' wall time beyond what they take with no save running, per save
    for i in range(args.drag_repeats):
        for _ in range(args.steps):
            out["step_before_async_s"].append(step())
            out["step_before_async_cpu_s"].append(cpu[-1])
        t0 = time.perf_counter()
        out["ours_async_stall_s"].append(timed(lambda i=i: asyn.save(i, state)))
        flag, before, during = torch.ones(1), out["step_before_async_s"][-args.steps :], []
        while flag.item():  # all ranks step until every rank's save is done
            during.append(step())
            out["step_during_async_s"].append(during[-1])
            out["step_during_async_cpu_s"].append(cpu[-1])
            flag = torch.tensor([float(asyn.saving)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        asyn.wait()
        out["async_save_s"].append(time.perf_counter() - t0)
        out["drag_per_save_s"].append(med(during) / med(before) - 1)
        out["drag_lost_per_save_s"].append(sum(during) - len(during) * med(before))
    return {f"{k[:-2]}{tag}_s": v for k, v in out.items()}


def opt_sd(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.state_dict() for k, v in state.items()}


def _raw_read(directory: Path) -> float:
    """Read every file of ``directory`` through one reused 16 MiB buffer (the bytes alone, no memory to fill)."""
    buf = memoryview(bytearray(1 << 24))
    t0 = time.perf_counter()
    for f in directory.iterdir():
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def _raw_read_fresh(directory: Path) -> float:
    """Read every file of ``directory`` into one new buffer of their total size: what any load into a process that
    has not held the state yet pays at least (the kernel's first-touch page faults included)."""
    import torch

    files = [f for f in directory.iterdir() if f.is_file()]
    t0 = time.perf_counter()
    buf = torch.empty(sum(f.stat().st_size for f in files), dtype=torch.uint8)
    view, at = memoryview(buf.numpy()).cast("B"), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view[at:]):
                at += n
    return time.perf_counter() - t0


def _evict(directory: Path) -> None:
    """Drop ``directory``'s files from the page cache (``POSIX_FADV_DONTNEED`` after ``fsync``; no root needed)."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- driver ----------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
    outs = [scratch / f"rank{r}.json" for r in range(2)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    argv = [sys.executable, __file__, "--worker", "--size", args.size, "--batch-size", str(args.batch_size)]
    argv += ["--seq-len", str(args.seq_len), "--steps", str(args.steps), "--repeats", str(args.repeats)]
    argv += ["--drag-repeats", str(args.drag_repeats)]
    argv += ["--dir", str(scratch)]
    procs = [subprocess.Popen([*argv, "--out", str(outs[r])], env=dict(env, RANK=str(r))) for r in range(2)]
    try:
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
        results = [json.loads(o.read_text()) for o in outs]
        results[0].update(measure_loads(scratch / "ours_sync", args))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def steady(xs: list[float]) -> float:
    """Median without the first repeat (fresh buffers, cold caches)."""
    return med(xs[1:]) if len(xs) > 1 else med(xs)


def report(results: list[dict[str, Any]], load_before: tuple[float, ...]) -> None:
    r0 = results[0]
    keys = [k for k in r0 if k.endswith("_s") and k in results[1] and not k.startswith("drag_")]
    worst = {k: max(steady(r[k]) for r in results) for k in keys}  # slowest rank, steady state
    first = {k: max(r[k][0] for r in results) for k in keys if r0[k]}
    step, save = worst["step_s"], worst["dcp_save_stall_s"]
    mib = r0["ckpt_bytes"] / 2**20
    print(f"model: {r0['params'] / 1e6:.1f}M parameters, 2 ranks, ZeroStage2 fp32 AdamW, checkpoint {mib:.0f} MiB")
    print(f"load average before: {load_before}, after: {os.getloadavg()}, cores: {os.cpu_count()}")
    print("\n| save (slowest rank) | first s | steady s (median of later) | steady vs dcp.save | steady vs step |")
    print("|---|---|---|---|---|")
    for key, label in [
        ("step_s", "training step (no save running)"),
        ("dcp_save_stall_s", "dcp.save stall"),
        ("dcp_async_stall_s", "dcp.async_save stall"),
        ("ours_sync_stall_s", "Checkpointer.save (sync) stall"),
        ("ours_async_stall_s", "Checkpointer.save (async) stall"),
        ("async_save_s", "async save, stall to commit (writer_priority='idle', default)"),
        ("async_save_nice19_s", "async save, stall to commit (writer_priority=19)"),
        ("async_save_nice0_s", "async save, stall to commit (writer_priority=0)"),
    ]:
        v = worst[key]
        print(f"| {label} | {first[key]:.3f} | {v:.3f} | {v / save:.3f} | {v / step:.3f} |")
    print("\n| steps while an async save is in flight (both ranks) | wall drag | CPU drag | per save: min, median, max "
          "| time lost per save: median s (steps) | saves | steps |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for tag, priority in WRITERS:
        per_save = sorted(max(a, b) for a, b in zip(*(r[f"drag_per_save{tag}_s"] for r in results), strict=True))
        spread = ", ".join(f"{x * 100:+.1f}%" for x in (per_save[0], med(per_save), per_save[-1]))
        lost = med([max(a, b) for a, b in zip(*(r[f"drag_lost_per_save{tag}_s"] for r in results), strict=True)])
        print(
            f"| writer_priority={priority!r} | {_drag(results, 'step', tag) * 100:+.1f}% | "
            f"{_drag(results, 'cpu', tag) * 100:+.1f}% | {spread} | {lost:.3f} ({lost / step:.2f}) | {len(per_save)} "
            f"| {len(r0[f'step_during_async{tag}_s'])} |"
        )
    head = "| load at world size 1 (rank 0), ZeroStage3 | page cache | s | vs raw read | vs read into new memory |"
    print(f"\n{head}")
    print("|---|---|---|---|---|")
    for cold in ("", "_cold"):
        raw, fresh = med(r0[f"raw_read{cold}_s"]), med(r0[f"raw_fresh{cold}_s"])
        for key, label in [
            ("raw_read", "raw read of the same files (one reused 16 MiB buffer)"),
            ("raw_fresh", "raw read into one new buffer of their size"),
            ("load_dcp", "dcp.load (same planner, template built)"),
            ("load_ours", "Checkpointer.load_latest (checksums verified)"),
            ("load_ours_nocrc", "Checkpointer.load_latest (verify_on_load=False)"),
        ]:
            v = med(r0[f"{key}{cold}_s"])
            print(f"| {label} | {'cold' if cold else 'warm'} | {v:.3f} | {v / raw:.2f} | {v / fresh:.2f} |")
    print("\ngoals (issue 8), steady state:")
    print(f"  async stall / dcp.save stall = {worst['ours_async_stall_s'] / save:.3f} (goal <= 0.1)")
    print(f"  async stall / step time      = {worst['ours_async_stall_s'] / step:.3f} (goal <= 0.10)")
    print(f"  step drag during async save  = {_drag(results, 'step', '') * 100:+.1f}% wall (goal <= 5%)")
    for cold in ("", "_cold"):
        load, raw, fresh = (med(r0[f"{k}{cold}_s"]) for k in ("load_ours", "raw_read", "raw_fresh"))
        print(
            f"  load (verified) / raw read, {'cold' if cold else 'warm'} page cache = {load / raw:.2f} "
            f"(goal <= 1.2; / raw read into new memory {load / fresh:.2f})"
        )


def _drag(results: list[dict[str, Any]], kind: str, tag: str) -> float:
    """Slowest rank's median step during async saves over its median step just before them, minus 1."""
    suffix = f"{tag}_s" if kind == "step" else f"_cpu{tag}_s"
    before, during = f"step_before_async{suffix}", f"step_during_async{suffix}"
    return max(med(r[during]) / med(r[before]) for r in results) - 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load_child:
        print(f"{load_child(args):.6f}")
        return 0
    if args.worker:
        res = worker(args)
        args.out.write_text(json.dumps(res))
        return 0
    load_before = os.getloadavg()
    results = run(args)
    ds = None if args.no_deepspeed else deepspeed(args)
    if args.out:
        args.out.write_text(json.dumps({"ours": results, "deepspeed": ds}, indent=1))
    report(results, load_before)
    if ds is not None:
        report_deepspeed(ds, results)
    return 0


def deepspeed(args: argparse.Namespace) -> dict[str, Any] | None:
    """DeepSpeed's figures for the same model and batch (bench/_ds_checkpoint.py in its own venv), same invocation."""
    if not args.ds_python.exists():
        print(f"(DeepSpeed columns skipped: no {args.ds_python}; bash bench/_ds_venv.sh)")
        return None
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_ds_") as tmp:
        out = Path(tmp) / "ds.json"
        argv = [str(args.ds_python), str(HERE / "_ds_checkpoint.py"), "--out", str(out), "--no-decoupled"]
        argv += ["--size", args.size, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
        subprocess.run(argv, check=True, timeout=args.timeout * 2, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def report_deepspeed(ds: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """DeepSpeed's save stall and its new-world-size load (ds_to_universal + load) beside ours."""
    ours_step = max(steady(r["step_s"]) for r in results)
    ours_save = max(steady(r["dcp_save_stall_s"]) for r in results)
    ours_async = max(steady(r["ours_async_stall_s"]) for r in results)
    r0 = results[0]
    print(f"\nDeepSpeed {ds.get('deepspeed', '?')} (ZeRO-2 fp32, same model and batch, 2 ranks; load at world 1):")
    print("| measure | DeepSpeed s | vs its step / raw read | elasticzero s | ours vs DeepSpeed |")
    print("|---|---|---|---|---|")
    ds_step, ds_save = med(ds["step_s"]), med(ds["save_stall_s"])
    print(f"| training step | {ds_step:.3f} | 1.000 | {ours_step:.3f} | {ours_step / ds_step:.3f} |")
    print(f"| save stall (ours: async) | {ds_save:.3f} | {ds_save / ds_step:.3f} | {ours_async:.3f} | "
          f"{ours_async / ds_save:.3f} |")  # fmt: skip
    print(f"| save stall (ours: dcp.save) | {ds_save:.3f} | {ds_save / ds_step:.3f} | {ours_save:.3f} | "
          f"{ours_save / ds_save:.3f} |")  # fmt: skip
    raw = med(ds["raw_read_ckpt_s"])
    new_world = med(ds["convert_s"]) + med(ds["load_s"])
    ours_load, ours_raw = med(r0["load_ours_s"]), med(r0["raw_read_s"])
    print(f"| ds_to_universal | {med(ds['convert_s']):.3f} | {med(ds['convert_s']) / raw:.1f} | - | - |")
    print(f"| load at world 1 (ours: checksums verified) | {med(ds['load_s']):.3f} | {med(ds['load_s']) / raw:.1f} | "
          f"{ours_load:.3f} | {ours_load / med(ds['load_s']):.3f} |")  # fmt: skip
    print(f"| new world size: convert + load | {new_world:.3f} | {new_world / raw:.1f} | {ours_load:.3f} | "
          f"{ours_load / new_world:.3f} |")  # fmt: skip
    print(f"(raw read: DeepSpeed's files {raw:.3f} s, ours {ours_raw:.3f} s; DeepSpeed's loaded parameters equal the "
          f"saved ones: {ds.get('load_matches_saved_params', '?')})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
