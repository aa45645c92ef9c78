"""Train a small byte-level GPT on the Python standard library's source, elastically, with a ZeRO stage.

The job to copy. Run it under ``elasticzero-launch`` / ``elasticzero-run`` / ``torchrun`` (they set RANK,
WORLD_SIZE, ...); run directly, it is a world of one::

    elasticzero-launch --nproc-per-node 2 examples/train_gpt.py --steps 20
    elasticzero-run --nnodes 1:2 --nproc-per-node 1 --rdzv-endpoint host:29400 --max-restarts 10 \\
        --elastic-config examples/configs/gpt.yaml \\
        examples/train_gpt.py --checkpoint-dir ckpt/ --save-every 10 --steps 500

Settings come from ``elasticzero.config`` (``--config``: a YAML file in ``examples/configs/`` or a DeepSpeed
``ds_config.json``); the flags below override it. The global batch stays the same at every world size (the
accumulation steps follow the world), so after losing or gaining a node the job resumes from the newest checkpoint
in ``--checkpoint-dir`` at exactly the next sample, and trains as an uninterrupted run would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elasticzero import autotune
from elasticzero.checkpoint import Checkpointer, RNGState
from elasticzero.config import build_pieces, elastic_batch, load_config
from elasticzero.data import ByteCorpus, ElasticLoader, ElasticSampler, stdlib_corpus
from elasticzero.engine.timers import PhaseTimers
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from gpt import GPT, config_for, lm_loss, num_params

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", "--ds-config", type=Path, default=HERE / "configs" / "gpt.yaml", help="config file")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage; 0 = plain DDP (config: zero.stage)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in total (default 40)")
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step, at every world size")
    p.add_argument("--micro-batch-size", type=int, help="sequences per rank per forward/backward")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="compute precision (config: precision.dtype)")
    p.add_argument("--seed", type=int, default=1234, help="model init and data order seed (default 1234)")
    p.add_argument("--checkpoint-dir", type=Path, help="save here; resume from the newest checkpoint in it")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (and at the end)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--size", default="small", help="GPT size from examples/gpt.py, vocabulary 256 (default small)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sample (default 128)")
    p.add_argument("--eval-every", type=int, default=0, help="eval loss every K steps (always at the end)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank (default 0)")
    p.add_argument("--corpus-bytes", type=int, default=8 << 20, help="bytes of stdlib source per split (8 MiB)")
    p.add_argument("--record-samples", type=Path, help="append each step's sample ids per rank to this JSONL file")
    p.add_argument("--hold-file", type=Path, help="at step N, wait while this file exists and holds a number <= N")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    """Flags that override the config file, as omegaconf dotlist entries."""
    pairs = [("zero.stage", args.zero), ("precision.dtype", args.precision)]
    pairs += [("train_batch_size", args.global_batch_size), ("micro_batch_size", args.micro_batch_size)]
    return [f"{key}={value}" for key, value in pairs if value is not None]


def init_distributed() -> tuple[int, int]:
    """``init_process_group`` from the launcher's env (gloo on CPU, nccl with CUDA); a world of one if unset."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29512")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


class ReplicatedState:
    """``Stateful`` model + optimizer for ``--zero 0`` (DDP), through torch's public DCP state-dict helpers."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self.options)  # fmt: skip


@torch.no_grad()
def eval_loss(net: nn.Module, data: ByteCorpus, micro: int, batches: int = 4) -> float:
    """Mean loss over the same ``batches x micro x world`` eval windows at any world size (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.arange(batches * micro * world) % len(data)
    total = torch.zeros(2)
    for b in range(batches):
        pairs = [data[int(i)] for i in ids[(b * world + rank) * micro :][:micro]]
        x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        total += torch.tensor([lm_loss(net(x), y).item() * len(x), len(x)])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed()
    try:
        cfg = load_config(args.config, overrides=overrides(args), world_size=world)  # fails here if no batch plan
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = GPT(config_for(args.size, vocab_size=256, block_size=args.seq_len))
        pieces = build_pieces(model, cfg)
        opt, scaler, acc = pieces.optimizer, pieces.scaler, pieces.accumulation
        zero = cfg.zero.stage
        net = nn.parallel.DistributedDataParallel(model) if zero == 0 else model

        cache = args.checkpoint_dir or Path(tempfile.gettempdir()) / "elasticzero-corpus"
        train_set = ByteCorpus(stdlib_corpus(cache, "train", max_bytes=args.corpus_bytes), args.seq_len)
        eval_set = ByteCorpus(stdlib_corpus(cache, "eval", max_bytes=args.corpus_bytes), args.seq_len)
        sampler = ElasticSampler(
            len(train_set), global_batch_size=cfg.train_batch_size or cfg.micro_batch_size * acc.steps * world,
            micro_batch_size=cfg.micro_batch_size, rank=rank, world_size=world, seed=args.seed,
            record=args.record_samples is not None,
        )  # fmt: skip
        loader = ElasticLoader(train_set, sampler, num_workers=args.workers)

        state: dict[str, Any] = {"model": ZeroCheckpointState(opt) if zero else ReplicatedState(model, opt)}
        state |= {"data": loader, "rng": RNGState()} | ({"scaler": scaler} if scaler is not None else {})
        ckpt_dir, async_save = args.checkpoint_dir, args.async_save
        ckpt = Checkpointer(ckpt_dir, keep_last=2, async_save=async_save) if ckpt_dir else None
        t_load = time.perf_counter()
        start = (ckpt.load_latest(state) if ckpt else None) or 0
        load_s = time.perf_counter() - t_load
        if rank == 0:
            print(
                f"train_gpt: params={num_params(model):,} world={world} zero={zero} "
                f"precision={cfg.precision.dtype.value} global batch={sampler.global_batch_size} = micro "
                f"{sampler.micro_batch_size} x accumulation {acc.steps} x {world}; {len(train_set):,} train samples; "
                f"resumed at step {start}",
                flush=True,
            )
            batch = elastic_batch(cfg, str(args.config))
            print(f"train_gpt: valid world sizes: {batch.valid_world_sizes() if batch else 'any'}", flush=True)

        attempt = attempt_id() if args.record_samples is not None else 0
        started = psutil.Process().create_time()  # this worker process's start (wall clock), for the record
        if args.hold_file is not None:
            hold(args.hold_file, start)
        batches, t0, tokens, timers = loader.endless(), time.perf_counter(), 0, PhaseTimers()
        autotune.measure(timers)  # under elasticzero-autotune: time its window of steps, report, stop (else no-op)
        for step in range(start + 1, args.steps + 1):
            total = torch.zeros(())
            for _ in range(acc.steps):
                x, y = next(batches)
                with acc.no_sync(net if zero == 0 else opt):
                    loss = acc.scale_loss(lm_loss(net(x), y))
                    (scaler.scale(loss) if scaler else loss).backward()
                total += loss.detach().float()
                tokens += x.numel() * world
                acc.advance()
            if scaler:
                scaler.unscale_(opt)
            pieces.clip_grad_norm_()
            scaler.step(opt) if scaler else opt.step()
            if scaler:
                scaler.update()
            opt.zero_grad(set_to_none=True)
            if args.record_samples is not None:
                record(args.record_samples, {"step": step, "rank": rank, "world": world, "attempt": attempt,
                                             "resumed": start, "started": started, "load_s": load_s},
                       sampler)  # fmt: skip
            dist.all_reduce(total)
            if rank == 0 and (step % 10 == 0 or step in (start + 1, args.steps)):
                rate = tokens / (time.perf_counter() - t0)
                print(f"step {step:5d}/{args.steps}  loss {total.item() / world:.4f}  {rate:,.0f} tokens/s", flush=True)
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                log_eval(net, eval_set, cfg.micro_batch_size, step, rank)
            if ckpt and ((args.save_every and step % args.save_every == 0) or step == args.steps):
                ckpt.save(step, state)
            if args.hold_file is not None:
                hold(args.hold_file, step)
            if timers.count(samples=cfg.micro_batch_size * acc.steps):  # the tuner's window is measured
                break
        log_eval(net, eval_set, cfg.micro_batch_size, args.steps, rank)
        if ckpt:
            ckpt.close()
    finally:
        dist.destroy_process_group()
    return 0


def log_eval(net: nn.Module, data: ByteCorpus, micro: int, step: int, rank: int) -> None:
    loss = eval_loss(net, data, micro)
    if rank == 0:
        print(f"step {step:5d}  eval loss {loss:.4f}", flush=True)


def hold(path: Path, step: int) -> None:
    """Wait (collectively: a lost peer fails the job) while ``path`` exists and names a step <= ``step``."""
    while True:
        flag = torch.tensor(int(dist.get_rank() == 0 and _held(path, step)))
        dist.broadcast(flag, 0)
        if not flag.item():
            return
        time.sleep(0.2)


def _held(path: Path, step: int) -> bool:
    try:
        return int(path.read_text().strip() or 0) <= step
    except (FileNotFoundError, ValueError):
        return False


def attempt_id() -> int:
    """One id per (re)start of the job, the same on every rank and larger at each restart (rank 0's clock)."""
    stamp = torch.tensor(time.time_ns(), dtype=torch.int64)
    dist.broadcast(stamp, 0)
    return int(stamp.item())


def record(path: Path, fields: dict[str, float], sampler: ElasticSampler) -> None:
    """The sample ids this rank trained on in one step (one JSON line; for tests of exactly-once resumption).

    ``fields``: step, rank, world, attempt (:func:`attempt_id`) and resumed (the step this attempt started after).
    A step redone after a failure is written again by the later attempt, which replaces the lost one; see
    docs/elastic-training.md ("The sample record").
    """
    assert sampler.record is not None
    samples, sampler.record[:] = list(sampler.record), []
    with path.open("a") as fh:  # one short line per write: O_APPEND keeps the ranks' lines whole
        fh.write(json.dumps({**fields, "time": time.time(), "samples": samples}) + "\n")


if __name__ == "__main__":
    with autotune.trial():  # under elasticzero-autotune an OOM is reported as "oom", any other error as "error"
        raise SystemExit(main())
