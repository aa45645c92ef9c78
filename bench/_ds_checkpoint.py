"""DeepSpeed's columns for ``bench/checkpoint_bench.py``: ZeRO-2 save stall, and ``ds_to_universal`` + load at world 1.

Runs under the DeepSpeed venv (``bash bench/_ds_venv.sh``), never the project's: it imports only torch, deepspeed,
the standard library and ``examples/gpt.py``. One invocation measures, on the same 29.5M GPT, batch and seq length as
checkpoint_bench's defaults (2 gloo ranks, ``DS_ACCELERATOR=cpu``, ZeRO stage 2, fp32 ``torch.optim.AdamW``):

1. ``step_s`` — one training step (forward, ``engine.backward``, ``engine.step``);
2. ``save_stall_s`` — how long ``engine.save_checkpoint(dir, tag)`` blocks the loop with DeepSpeed's default
   (``torch.save``) checkpoint engine;
3. ``decoupled_*`` — the same with its decoupled checkpoint engine (``"checkpoint": {"writer": {"type": "python",
   "decoupled": true}}``: a writer process per rank). Its save returns after queueing the state, but the next
   ``engine.step()`` waits for the write to commit before it mutates anything, so the loop is blocked for
   ``decoupled_blocked_s`` = save call + that step's excess over a plain step. In 0.19.8 with ZeRO-2 on CPU its
   save fails (the fp32 master partition is a non-leaf view that requires grad, which torch.multiprocessing refuses
   to send to the writer process); the run then records ``decoupled_error`` and goes on;
4. ``convert_s`` — ``python -m deepspeed.checkpoint.ds_to_universal`` (as DeepSpeed documents it, a separate
   process; ``--inject_missing_state`` because a plain model has no Megatron universal-checkpoint info), with the
   child's CPU seconds in ``convert_cpu_s``;
5. ``load_s`` — one rank alone (world size 1) builds a fresh engine with ``"checkpoint": {"load_universal": true}``
   and times ``engine.load_checkpoint(dir)`` (tag from ``latest_universal``); ``raw_read_universal_s`` /
   ``raw_read_ckpt_s`` read the same files (page cache warm) as checkpoint_bench's ``_raw_read`` does.
   ``--load-stage 3`` loads into ZeRO-3 instead; in 0.19.8 that fails for a ZeRO-2 checkpoint (the ZeRO-3 loader
   looks for ``zero_pp_rank_0_mp_rank_*_model_states.pt``, the converted ZeRO-2 checkpoint has ``mp_rank_00_...``:
   ``assert len(self.ckpt_list) > 0`` in ``state_dict_factory``), recorded as ``load_error``.

Every measure has its first call in ``<name>_first_s`` and the steady-state samples in ``<name>_s`` (two-rank
measures: the slower rank per sample), and where it means something the process CPU seconds in ``<name>_cpu_s``
(far less inflated by machine load than wall times). Writes one JSON dict to ``--out`` and prints a small table.

    /work/ds-venv/bin/python bench/_ds_checkpoint.py --out /tmp/ds_checkpoint.json
    /work/ds-venv/bin/python bench/_ds_checkpoint.py --out F --size small --repeats 1   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
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
EXAMPLES = HERE.parent / "examples"
UNIVERSAL_SUFFIX = "_universal"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="write the JSON dict here")
    p.add_argument("--size", default="bench", help="GPT size from examples/gpt.py (default bench, ~29.5M)")
    p.add_argument("--batch-size", type=int, default=2, help="micro-batch per rank (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--steps", type=int, default=4, help="timed steady-state steps (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="steady-state saves/conversions/loads after the first (2)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint scratch directory (default: a temp dir, removed)")
    p.add_argument("--load-stage", type=int, choices=[2, 3], default=2, help="ZeRO stage loaded at world 1 (2)")
    p.add_argument("--no-decoupled", action="store_true", help="skip the decoupled checkpoint engine run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per phase before its processes are killed")
    p.add_argument("--role", choices=["train", "load"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=["torch", "decoupled"], default="torch", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- pure: configs and summaries --------------------------------------------------------------------------------------
def ds_config(batch_size: int, engine: str = "torch", load_universal: bool = False, stage: int = 2) -> dict[str, Any]:
    """DeepSpeed config: ZeRO ``stage``, no clipping (DeepSpeed's default clips at 1.0; checkpoint_bench does not)."""
    checkpoint: dict[str, Any] = {"load_universal": load_universal}
    if engine == "decoupled":
        # data_parallel "replica": every rank writes its own shard. Left unset (DeepSpeed's default), 0.19.8 fails at
        # initialize: AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank'.
        checkpoint["writer"] = {"type": "python", "decoupled": True, "data_parallel": "replica"}
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "checkpoint": checkpoint,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def slowest_rank(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the ranks' results: for each ``*_s`` list, the per-sample maximum; other keys from rank 0."""
    merged = dict(per_rank[0])
    for key, value in per_rank[0].items():
        if key.endswith("_s") and isinstance(value, list):
            merged[key] = [max(samples) for samples in zip(*(r[key] for r in per_rank), strict=True)]
    return merged


def blocked_by_decoupled(stalls: list[float], next_steps: list[float], plain_step: float) -> list[float]:
    """Loop time lost per decoupled save: the save call plus the next step's excess over a plain step."""
    return [s + max(0.0, n - plain_step) for s, n in zip(stalls, next_steps, strict=True)]


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- rank side (runs in the DeepSpeed venv) ---------------------------------------------------------------------------
def _build_engine(
    args: argparse.Namespace, seed: int, engine: str, load_universal: bool, stage: int = 2
) -> tuple[Any, Any]:
    import deepspeed
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from gpt import GPT, config_for

    cfg = config_for(args.size, block_size=max(args.seq_len, config_for(args.size).block_size))
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = ds_config(args.batch_size, engine, load_universal, stage)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    torch.set_num_threads(1)
    return eng, cfg


def _stepper(eng: Any, cfg: Any, args: argparse.Namespace, rank: int) -> Any:
    import torch

    from gpt import lm_loss, synthetic_batch

    x, y = synthetic_batch(cfg, args.batch_size, args.seq_len, torch.Generator().manual_seed(1 + rank))

    def step() -> None:
        eng.backward(lm_loss(eng(x), y))
        eng.step()

    return step


def clocked(fn: Any, *fn_args: Any) -> tuple[float, float]:
    """``fn(*fn_args)``'s wall seconds and this process's CPU seconds (all threads) while it ran."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn(*fn_args)
    return time.perf_counter() - w0, time.process_time() - c0


def record(res: dict[str, Any], name: str, samples: list[tuple[float, float]]) -> None:
    """``samples`` (wall, cpu) as ``<name>_first_s`` / ``<name>_s`` and ``<name>_cpu_first_s`` / ``<name>_cpu_s``."""
    for suffix, values in (("", [w for w, _ in samples]), ("_cpu", [c for _, c in samples])):
        res[f"{name}{suffix}_first_s"], res[f"{name}{suffix}_s"] = values[:1], values[1:]


def _timed_save(eng: Any, directory: Path, tag: str) -> tuple[float, float]:
    from deepspeed import comm

    comm.barrier()
    return clocked(eng.save_checkpoint, str(directory), tag)


def train_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One of 2 ranks: steps, then 1 + repeats saves with ``args.engine``; the last tag stays on disk."""
    import deepspeed
    from deepspeed import comm

    deepspeed.init_distributed(dist_backend="gloo")
    rank = comm.get_rank()
    eng, cfg = _build_engine(args, seed=0, engine=args.engine, load_universal=False)
    step = _stepper(eng, cfg, args, rank)
    res: dict[str, Any] = {
        "params": sum(p.numel() for p in eng.module.parameters()),
        "deepspeed": deepspeed.__version__,
    }
    record(res, "step", [clocked(step) for _ in range(1 + args.steps)])
    root = args.dir / args.engine
    stalls, next_steps = [], []
    try:
        for i in range(1 + args.repeats):
            stalls.append(_timed_save(eng, root, f"t{i}"))
            next_steps.append(clocked(step))  # a decoupled engine commits (waits for its writer) inside this step
            comm.barrier()
            if rank == 0 and i:
                shutil.rmtree(root / f"t{i - 1}")
    except Exception:
        _stop_writer(eng)
        raise
    record(res, "save_stall", stalls)
    record(res, "next_step", next_steps)
    res["tag"] = f"t{args.repeats}"
    if args.engine == "decoupled":
        eng.checkpoint_engine.cleanup()
    comm.barrier()
    return res


def _stop_writer(eng: Any) -> None:
    """Kill a decoupled engine's writer process: it is not a daemon, so exit would otherwise wait for it forever."""
    proc = getattr(eng.checkpoint_engine, "ckpt_process", None)
    if proc is not None and proc.is_alive():
        proc.kill()
        proc.join()


def load_rank(args: argparse.Namespace) -> dict[str, Any]:
    """World size 1: 1 + repeats loads of the universal checkpoint, each into a freshly built engine."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    root = args.dir / "torch"
    tag = (root / "latest_universal").read_text().strip()
    loads, raw_u, raw_c, res = [], [], [], {}
    for i in range(1 + args.repeats):
        raw_u.append(raw_read(root / tag))
        raw_c.append(raw_read(root / tag.removesuffix(UNIVERSAL_SUFFIX)))
        eng, cfg = _build_engine(args, seed=1 + i, engine="torch", load_universal=True, stage=args.load_stage)
        loads.append(clocked(eng.load_checkpoint, str(root)))  # tag from root/latest_universal
        res["load_matches_saved_params"] = _matches_saved(eng, root / tag.removesuffix(UNIVERSAL_SUFFIX))
        res["step_after_load_s"] = [clocked(_stepper(eng, cfg, args, 0))[0]]
        del eng
    record(res, "load", loads)
    res["raw_read_universal_s"], res["raw_read_ckpt_s"] = raw_u[1:], raw_c[1:]
    res["universal_bytes"] = tree_bytes(root / tag)
    res["ckpt_bytes"] = tree_bytes(root / tag.removesuffix(UNIVERSAL_SUFFIX))
    torch.distributed.destroy_process_group()
    return res


def _matches_saved(eng: Any, tag_dir: Path) -> bool:
    """The loaded module equals the model state the 2-rank run saved (bit-exact fp32)."""
    import deepspeed
    import torch

    saved = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    params = dict(eng.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):  # a no-op below stage 3
        return all(torch.equal(p.detach(), saved[n]) for n, p in params.items())


def raw_read(directory: Path) -> float:
    """Read every file under ``directory`` (recursively) once, 16 MiB at a time."""
    t0 = time.perf_counter()
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    return time.perf_counter() - t0


def tree_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


# -- driver -----------------------------------------------------------------------------------------------------------


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        **{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CROSS_RANK": "0", "CROSS_SIZE": "1"},
        **{"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"},
    }


def common_flags(args: argparse.Namespace) -> list[str]:
    flags = [f"--size={args.size}", f"--batch-size={args.batch_size}", f"--seq-len={args.seq_len}"]
    flags += [f"--steps={args.steps}", f"--repeats={args.repeats}", f"--load-stage={args.load_stage}"]
    return [*flags, f"--dir={args.dir}"]


def run_ranks(args: argparse.Namespace, role: str, world: int, engine: str = "torch") -> list[dict[str, Any]]:
    """Start ``world`` processes of this file in ``role``; return their JSON results or raise with the log tail."""
    port, procs, logs = free_port(), [], []
    for rank in range(world):
        out, log = args.dir / f"{role}-{engine}-{rank}.json", args.dir / f"{role}-{engine}-{rank}.log"
        argv = [sys.executable, __file__, f"--role={role}", f"--engine={engine}", f"--out={out}", *common_flags(args)]
        with open(log, "w") as log_f:
            procs.append(
                subprocess.Popen(argv, env=rank_env(rank, world, port), stdout=log_f, stderr=subprocess.STDOUT)
            )
        logs.append((out, log))
    try:
        wait_all(procs, args.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    pairs = zip(procs, logs, strict=True)
    failed = [(p.returncode, log) for p, (out, log) in pairs if p.returncode or not out.is_file()]
    if failed:  # the rank that failed by itself first, not one killed above (negative exit code)
        code, log = max(failed, key=lambda f: (f[0] or 0) > 0)
        raise RuntimeError(f"{role} rank exited {code}: {error_line(log)} (log: {log})")
    return [json.loads(out.read_text()) for out, _ in logs]


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every process exits, or one fails (its peers would block in a collective), or ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            return
        time.sleep(0.5)


def error_line(log: Path) -> str:
    """The rank's own exception line (``[rankN]: XError: ...``), else the log's last non-blank line."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    ours = [i for i, ln in enumerate(lines) if re.match(r"\[rank\d+\]: \w+(Error|Exception)\b", ln)]
    if not ours:
        return (lines or ["no output"])[-1][-600:]
    i = ours[-1]
    if ": " in lines[i][9:]:
        return lines[i][-600:]
    src = [ln for ln in lines[:i] if ln.split("]: ", 1)[-1].strip(" ^")]  # a bare AssertionError: its source line
    return f"{(src or [''])[-1].strip()} -> {lines[i]}"[-600:]


def convert(args: argparse.Namespace, tag: str) -> dict[str, list[float]]:
    """Run ``ds_to_universal`` 1 + repeats times on ``tag`` (wall and child CPU seconds); leave the last output."""
    root = args.dir / "torch"
    src, dst = root / tag, root / f"{tag}{UNIVERSAL_SUFFIX}"
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", f"--input_folder={src}"]
    argv += [f"--output_folder={dst}", "--inject_missing_state"]
    walls, cpus = [], []
    for _ in range(1 + args.repeats):
        shutil.rmtree(dst, ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(argv, env=rank_env(0, 1, 0), capture_output=True, text=True, timeout=args.timeout)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if done.returncode != 0:
            raise RuntimeError(f"ds_to_universal exited {done.returncode}: {done.stderr.strip()[-600:]}")
    # ds_to_universal itself writes root/latest_universal (= dst.name), where load_checkpoint reads the tag
    res = {"convert_first_s": walls[:1], "convert_s": walls[1:]}
    return {**res, "convert_cpu_first_s": cpus[:1], "convert_cpu_s": cpus[1:]}


def decoupled_columns(args: argparse.Namespace) -> dict[str, Any]:
    """The decoupled checkpoint engine's run, as ``decoupled_*`` keys (or ``decoupled_error``)."""
    try:
        r = slowest_rank(run_ranks(args, "train", 2, engine="decoupled"))
    except RuntimeError as exc:
        return {"decoupled_error": str(exc)}
    plain = med(r["step_s"])
    keys = ("step_s", "step_cpu_s", "save_stall_first_s", "save_stall_s", "save_stall_cpu_s", "next_step_s")
    out = {f"decoupled_{k}": r[k] for k in keys}
    out["decoupled_blocked_first_s"] = blocked_by_decoupled(r["save_stall_first_s"], r["next_step_first_s"], plain)
    out["decoupled_blocked_s"] = blocked_by_decoupled(r["save_stall_s"], r["next_step_s"], plain)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every phase (2-rank train+save, conversion, 1-rank load); one dict of ``*_s`` sample lists and facts."""
    scratch = args.dir is None
    args.dir = Path(tempfile.mkdtemp(prefix="ds_ckpt_bench_")) if scratch else args.dir
    args.dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"load_before": os.getloadavg()[0], "cpus": os.cpu_count(), "load_stage": args.load_stage}
    try:
        train = slowest_rank(run_ranks(args, "train", 2))
        res.update({k: v for k, v in train.items() if not k.startswith("next_step")})  # decoupled-only
        if not args.no_decoupled:
            res.update(decoupled_columns(args))
        res.update(convert(args, train["tag"]))
        try:
            res.update(run_ranks(args, "load", 1)[0])
        except RuntimeError as exc:
            res["load_error"] = str(exc)
    finally:
        if scratch:
            shutil.rmtree(args.dir, ignore_errors=True)
    res["load_after"] = os.getloadavg()[0]
    return res


ROWS = [
    ("step_s", "training step (ZeRO-2, 2 ranks)"),
    ("save_stall_s", "save_checkpoint stall (torch engine)"),
    ("decoupled_save_stall_s", "save_checkpoint call (decoupled engine)"),
    ("decoupled_blocked_s", "loop blocked per save (decoupled: call + next-step wait)"),
    ("convert_s", "ds_to_universal (separate process; CPU = child's)"),
    ("raw_read_universal_s", "raw read of the universal files"),
    ("raw_read_ckpt_s", "raw read of the saved checkpoint files"),
    ("load_s", "load_checkpoint(load_universal) at world 1"),
]


def table(res: dict[str, Any]) -> str:
    """Markdown: first call, steady-state median (wall and CPU seconds), and the ratio to one training step."""
    lines = ["| measure | first call s | steady median s | steady CPU s | vs one step |", "|---|---|---|---|---|"]
    step = med(res.get("step_s", []))
    for key, label in ROWS:
        if res.get(key):
            first, cpu = res.get(key.removesuffix("_s") + "_first_s"), res.get(key.removesuffix("_s") + "_cpu_s")
            cells = [f"{first[0]:.3f}" if first else "-", f"{med(res[key]):.3f}", f"{med(cpu):.3f}" if cpu else "-"]
            lines.append(f"| {label} | {' | '.join(cells)} | {med(res[key]) / step:.2f} |")
    lines.append(f"\nloaded parameters equal the saved ones: {res.get('load_matches_saved_params')}")
    for key in ("decoupled_error", "load_error"):
        if key in res:
            lines.append(f"\n{key}: {res[key]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        rank_fn = train_rank if args.role == "train" else load_rank
        args.out.write_text(json.dumps(rank_fn(args)))
        return 0
    res = measure(args)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"DeepSpeed {res.get('deepspeed')} ZeRO-2 fp32 AdamW, {res.get('params', 0) / 1e6:.1f}M params, CPU gloo;")
    print(f"universal checkpoint loaded at world 1 into ZeRO-{args.load_stage}")
    print(f"load average {res['load_before']:.2f} -> {res['load_after']:.2f}, {res['cpus']} cpus\n" + table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
