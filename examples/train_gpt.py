"""Train the small GPT with an elasticzero ZeRO stage (or plain DDP) on synthetic data.

Run under ``elasticzero-launch`` / ``elasticzero-run`` / ``torchrun``, which set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; run directly, it is a world of one on 127.0.0.1::

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --zero 2 --steps 20
    python examples/train_gpt.py --zero 0 --steps 5

The training loop is the plain torch loop: forward, loss, ``backward``, clip, ``step``, ``zero_grad``. The ZeRO
stage is an optimizer wrapper; nothing owns the loop. With ``--precision fp16`` an ``elasticzero.LossScaler`` (shaped
like ``torch.amp.GradScaler``) scales the loss and skips steps with inf/NaN gradients on every rank alike.

Data is synthetic and made locally (no downloads): every rank draws its own micro-batches from a seeded generator,
so the global batch is ``world_size * batch_size``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT, SIZES, config_for, lm_loss, num_params, synthetic_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; a DeepSpeed-style ``--ds-config`` supplies defaults that explicit flags override."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage; 0 = plain DDP (default 2)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="GPT size (default tiny)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40)")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch per rank (default 8)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--clip", type=float, default=None, help="global gradient-norm clip, 0 = off (default 1.0)")
    p.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="ZeRO compute precision; DDP is fp32"
    )
    p.add_argument("--seed", type=int, default=1234, help="model init seed (same on every rank)")
    p.add_argument("--ds-config", type=Path, default=None, help="DeepSpeed-style JSON (e.g. examples/ds_config.json)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    return p.parse_args(argv)


def apply_ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """Fill unset flags from the few DeepSpeed keys this example reads; returns the parsed JSON.

    The full mapping (with strict validation and a report of unsupported keys) belongs to ``elasticzero.config``;
    this example reads only what it uses so it stays runnable on its own.
    """
    cfg: dict[str, Any] = json.loads(args.ds_config.read_text()) if args.ds_config else {}
    opt_params = cfg.get("optimizer", {}).get("params", {})
    defaults = {
        "zero": cfg.get("zero_optimization", {}).get("stage", 2),
        "batch_size": cfg.get("train_micro_batch_size_per_gpu", 8),
        "lr": opt_params.get("lr", 3e-3),
        "clip": cfg.get("gradient_clipping", 1.0),
        "steps": 40,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.precision == "fp32":
        if cfg.get("bf16", {}).get("enabled"):
            args.precision = "bf16"
        elif cfg.get("fp16", {}).get("enabled"):
            args.precision = "fp16"
    return cfg


def init_distributed() -> tuple[int, int, torch.device]:
    """``init_process_group`` from the launcher's env (gloo on CPU, nccl with CUDA); a world of one if unset."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size(), device


def build_optimizer(model: nn.Module, args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any]:
    """The model to call and the optimizer to step: a ZeRO stage wrapper, or DDP + AdamW for ``--zero 0``."""
    if args.zero == 0:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    try:
        import elasticzero  # lazy: the DDP path needs nothing from the package

        stage_cls = getattr(elasticzero, f"ZeroStage{args.zero}")
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"train_gpt: ZeroStage{args.zero} is not available ({exc}); use --zero 0 for DDP") from exc
    return model, stage_cls(model, torch.optim.AdamW, lr=args.lr, precision=args.precision)


def make_scaler(precision: str) -> Any:
    """A dynamic ``LossScaler`` for fp16 (bf16 and fp32 need none)."""
    if precision != "fp16":
        return None
    from elasticzero import LossScaler

    return LossScaler()


def clip_gradients(model: nn.Module, opt: Any, max_norm: float) -> float:
    """Clip by global norm; ZeRO stages know their shards, DDP grads are already whole."""
    if max_norm <= 0:
        return float("nan")
    clip = getattr(opt, "clip_grad_norm_", None)
    norm = clip(max_norm) if clip is not None else nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm)


def main(argv: list[str] | None = None) -> int:
    """Train ``--steps`` steps, print the loss each step and a final summary line on rank 0."""
    args = parse_args(argv)
    apply_ds_config(args)
    if args.zero == 0 and args.precision != "fp32":
        raise SystemExit("train_gpt: --precision applies to the ZeRO stages; --zero 0 (DDP) runs fp32")
    torch.set_num_threads(args.threads)
    rank, world, device = init_distributed()
    try:
        cfg = config_for(args.size, block_size=max(args.seq_len, config_for(args.size).block_size))
        torch.manual_seed(args.seed)  # same initial weights on every rank
        model = GPT(cfg).to(device)
        net, opt = build_optimizer(model, args, device)
        scaler = make_scaler(args.precision)
        gen = torch.Generator().manual_seed(args.seed + 1000 * (rank + 1))  # each rank its own data
        if rank == 0:
            print(
                f"train_gpt: size={args.size} params={num_params(model):,} world={world} "
                f"zero={args.zero} precision={args.precision} batch/rank={args.batch_size} seq={args.seq_len}",
                flush=True,
            )
        t0, first, loss_val = time.perf_counter(), float("nan"), float("nan")
        for step in range(1, args.steps + 1):
            x, y = (t.to(device) for t in synthetic_batch(cfg, args.batch_size, args.seq_len, gen))
            loss = lm_loss(net(x), y)
            if scaler is None:
                loss.backward()
                norm = clip_gradients(net, opt, args.clip)
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)  # clip the true gradients
                norm = clip_gradients(net, opt, args.clip)
                scaler.step(opt)  # skipped on every rank if any rank saw inf/NaN
                scaler.update()
            opt.zero_grad(set_to_none=True)
            avg = loss.detach().float()
            dist.all_reduce(avg)  # for printing only: the mean loss over ranks
            loss_val = avg.item() / world
            first = loss_val if step == 1 else first
            if rank == 0:
                print(f"step {step:4d}  loss {loss_val:.4f}  grad-norm {norm:.3f}", flush=True)
        if rank == 0:
            print(
                f"train_gpt: done {args.steps} steps in {time.perf_counter() - t0:.1f}s  "
                f"loss {first:.4f} -> {loss_val:.4f}",
                flush=True,
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
