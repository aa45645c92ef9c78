"""Train a small byte-level GPT on the Python standard library's source, elastically, with a ZeRO stage.

Run it under ``elasticzero-launch`` / ``elasticzero-run`` / ``torchrun``, or directly (a world of one), e.g.
``elasticzero-launch --nproc-per-node 2 examples/train_gpt.py --steps 20``: on ``cuda:$LOCAL_RANK`` over NCCL where
CUDA is available, else on the CPU over gloo. ``--config`` is a YAML file of ``examples/configs/`` or a DeepSpeed
``ds_config.json``; the flags override it. The global batch is the same at every world size. The loop is
:class:`elasticzero.Training`'s, one for every mode: after losing or gaining a node a plain job resumes from its newest
checkpoint at exactly the next sample; under ``elasticzero-run --live-recovery`` the running workers reshard the ZeRO
state in memory and go on from the last committed step (docs/elastic-training.md, "Live recovery").
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticzero import Training, autotune
from elasticzero.config import build_pieces, elastic_batch, load_config
from elasticzero.data import ByteCorpus, stdlib_corpus
from elasticzero.live import Done, Hooks
from gpt import GPT, config_for, lm_loss, num_params

HERE = Path(__file__).resolve().parent


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "--ds-config", type=Path, default=HERE / "configs" / "gpt.yaml", help="config file")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage; 0 = plain DDP (zero.stage)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in total (default 40)")
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step, at every world size")
    p.add_argument("--micro-batch-size", type=int, help="sequences per rank per forward/backward")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="compute precision (precision.dtype)")
    p.add_argument("--seed", type=int, default=1234, help="model init and data order seed (default 1234)")
    p.add_argument("--checkpoint-dir", type=Path, help="save here; resume from the newest checkpoint in it")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (and at the end)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--size", default="small", help="GPT size from examples/gpt.py, vocabulary 256 (default small)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sample (default 128)")
    p.add_argument("--eval-every", type=int, default=0, help="eval loss every K steps (always at the end)")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints every K-th step's loss (default 10)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank (default 0)")
    p.add_argument("--corpus-bytes", type=int, default=8 << 20, help="bytes of stdlib source per split (8 MiB)")
    p.add_argument("--cache-dir", type=Path, help="corpus cache (default $XDG_CACHE_HOME or ~/.cache/elasticzero)")
    return p


def overrides(args: argparse.Namespace) -> list[str]:
    """The flags that override the config file, as an omegaconf dotlist."""
    flags = {"zero.stage": args.zero, "precision.dtype": args.precision, "micro_batch_size": args.micro_batch_size,
             "train_batch_size": args.global_batch_size}  # fmt: skip
    return [f"{key}={value}" for key, value in flags.items() if value is not None]


def training(args: argparse.Namespace, hooks: Sequence[Hooks] = ()) -> Training:
    """The job: the GPT and its engine pieces on each round's group, the LM loss of one micro-batch, the data."""
    data = (stdlib_corpus(args.cache_dir, split, max_bytes=args.corpus_bytes) for split in ("train", "eval"))
    train, held_out = (ByteCorpus(d, args.seq_len) for d in data)

    def make_model(device: torch.device) -> torch.nn.Module:  # a live joiner's is made while its peers train on
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        return GPT(config_for(args.size, vocab_size=256, block_size=args.seq_len)).to(device)

    @functools.cache
    def config(world_size: int) -> Any:  # read once per world size: a live round's build is on its switch's path
        return load_config(args.config, overrides=overrides(args), world_size=world_size)

    def build(
        group: dist.ProcessGroup, device: torch.device, model: torch.nn.Module, sync_module_states: bool = True
    ) -> tuple[torch.nn.Module, Any]:  # a live survivor's model is its own, kept; False: the peers' state follows
        cfg = config(dist.get_world_size(group))
        return model, build_pieces(model, cfg, process_group=group, sync_module_states=sync_module_states)

    def loss(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lm_loss(net(batch[0]), batch[1])

    return Training(build, loss, train, steps=args.steps, seed=args.seed, make_model=make_model,
                    checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, async_save=args.async_save,
                    eval_dataset=held_out, eval_every=args.eval_every, num_workers=args.workers,
                    hooks=hooks)  # fmt: skip


def describe(args: argparse.Namespace, t: Training) -> str:
    """The model, the batch plan at this world size and where the job resumed."""
    cfg, s = t.pieces.config, t.sampler
    batch = elastic_batch(cfg, str(args.config))
    return (f"train_gpt: params={num_params(t.model):,} world={t.world} zero={cfg.zero.stage} on {t.device} "
            f"precision={cfg.precision.dtype.value} global batch={s.global_batch_size} = micro {s.micro_batch_size} x "
            f"accumulation {s.accumulation_steps} x {t.world} (valid world sizes: "
            f"{batch.valid_world_sizes() if batch else 'any'}); resumed at step {t.resumed}")  # fmt: skip


def log(args: argparse.Namespace, t: Training, done: Done, t0: float) -> None:
    """Rank 0: every ``--log-every``-th step's loss (and the first and last), every evaluation."""
    if t.rank != 0:
        return
    if done.eval_loss is not None:
        print(f"step {done.step:5d}  eval loss {done.eval_loss:.4f}", flush=True)
    elif done.step % args.log_every == 0 or done.step in (t.resumed + 1, args.steps):
        rate = (done.step - t.resumed) * t.sampler.global_batch_size * args.seq_len / (time.perf_counter() - t0)
        print(f"step {done.step:5d}/{args.steps}  loss {done.loss:.4f}  world {t.world}  {rate:,.0f} tokens/s",
              flush=True)  # fmt: skip


def main(argv: list[str] | None = None, hooks: Sequence[Hooks] = ()) -> int:
    args = parser().parse_args(argv)
    with training(args, hooks) as t:  # enters the first round: under --live-recovery the agent's, else this world
        if t.rank == 0:
            print(describe(args, t), flush=True)
        autotune.measure(t.pieces.timers)  # under elasticzero-autotune: time its window of steps (else no-op)
        t0 = time.perf_counter()
        for done in t:  # every committed step once, and every evaluation
            log(args, t, done, t0)
    return 0


if __name__ == "__main__":
    with autotune.trial():  # under elasticzero-autotune an OOM is reported as "oom", any other error as "error"
        raise SystemExit(main())
