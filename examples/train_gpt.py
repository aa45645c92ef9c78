"""Train a small byte-level GPT on the Python standard library's source, elastically, with a ZeRO stage.

Run it under ``elasticzero-launch`` / ``elasticzero-run`` / ``torchrun``, or directly (a world of one), e.g.
``elasticzero-launch --nproc-per-node 2 examples/train_gpt.py --steps 20``: on ``cuda:$LOCAL_RANK`` over NCCL where
CUDA is available, else on the CPU over gloo. ``--config`` is a YAML file of ``examples/configs/`` or a DeepSpeed
``ds_config.json``; the flags override it. The global batch is the same at every world size: after losing or gaining a
node the job resumes from its newest checkpoint at exactly the next sample. Under ``elasticzero-run --live-recovery``
(:class:`LiveTrainer`) a lost, frozen or joining node does not restart the survivors: they reshard the ZeRO state in
memory from their peers' copies and go on from the last committed step (docs/elastic-training.md, "Live recovery").
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from elasticzero import autotune, init_distributed
from elasticzero.checkpoint import Checkpointer, RNGState
from elasticzero.config import build_pieces, elastic_batch, load_config
from elasticzero.data import ByteCorpus, ElasticSampler, build_loader, stdlib_corpus
from elasticzero.device import Facts, placement
from elasticzero.engine import GradAccumulation
from elasticzero.errors import UsageError
from elasticzero.live import ROUND_FILE_ENV, LiveTraining
from gpt import GPT, config_for, lm_loss, num_params

HERE = Path(__file__).resolve().parent


class Trainer:
    """Model, engine pieces, data and checkpoints of one (re)start of the job; :meth:`train` runs it."""

    @staticmethod
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
        p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank (default 0)")
        p.add_argument("--corpus-bytes", type=int, default=8 << 20, help="bytes of stdlib source per split (8 MiB)")
        p.add_argument("--cache-dir", type=Path, help="corpus cache (default $XDG_CACHE_HOME or ~/.cache/elasticzero)")
        return p

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device, self.step = args, device, 0
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cfg = load_config(args.config, overrides=overrides(args), world_size=self.world)  # fails if no batch plan
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.model = GPT(config_for(args.size, vocab_size=256, block_size=args.seq_len)).to(device)
        self.pieces = build_pieces(self.model, self.cfg)
        self.net = self.pieces.wrap(self.model)  # DDP at stage 0, the model itself under ZeRO
        data = (stdlib_corpus(args.cache_dir, split, max_bytes=args.corpus_bytes) for split in ("train", "eval"))
        train, self.eval_set = (ByteCorpus(d, args.seq_len) for d in data)
        self.loader, self.acc = build_loader(train, self.cfg, rank=self.rank, world_size=self.world, seed=args.seed,
                                             num_workers=args.workers, pin_memory=device.type == "cuda")  # fmt: skip
        self.state = {**self.pieces.stateful(self.model), "data": self.loader, "rng": RNGState()}
        self.ckpt = args.checkpoint_dir and Checkpointer(args.checkpoint_dir, keep_last=2, async_save=args.async_save)

    def load(self) -> int:
        """Resume from the newest checkpoint (model, optimizer, data position, RNG); the step it was taken after."""
        return (self.ckpt.load_latest(self.state) if self.ckpt else None) or 0

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The model's loss on one micro-batch, on this worker's device, in the config's precision."""
        with self.pieces.autocast():
            return lm_loss(self.net(x.to(self.device, non_blocking=True)), y.to(self.device, non_blocking=True))

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over one global batch; this rank's loss."""
        total = torch.zeros((), device=self.device)
        for _ in range(self.acc.steps):
            with self.acc.no_sync(self.net, self.pieces.optimizer):  # DDP's or ZeRO's, except on the last
                loss = self.acc.scale_loss(self.loss(*next(batches)))
                self.pieces.backward(loss)
            total += loss.detach().float()
            self.acc.advance()
        self.pieces.step()  # unscale → clip → step → update the loss scale → zero_grad
        return total

    def train(self) -> None:
        """Resume, then train to ``--steps``: log, eval and checkpoint as the flags ask."""
        args, start, timers = self.args, self.load(), self.pieces.timers
        self.step, batches, t0 = start, self.loader.endless(), time.perf_counter()
        if self.rank == 0:
            print(self.describe(start), flush=True)
        autotune.measure(timers)  # under elasticzero-autotune: time its window of steps, report, stop (else no-op)
        try:
            while self.step < args.steps:
                self.step += 1
                self.log(self.train_step(batches), start, t0)
                if args.eval_every and self.step % args.eval_every == 0 and self.step < args.steps:
                    self.evaluate()
                if self.ckpt and ((args.save_every and self.step % args.save_every == 0) or self.step == args.steps):
                    self.ckpt.save(self.step, self.state)
                if timers.count(samples=self.loader.sampler.micro_batch_size * self.acc.steps):  # the tuner's window
                    break
            self.evaluate()
        finally:  # an error too: no background save is left running (close waits for it, then stops its thread)
            if self.ckpt:
                self.ckpt.close()

    def describe(self, start: int) -> str:
        """The model, the batch plan at this world size and where the job resumed."""
        s, batch = self.loader.sampler, elastic_batch(self.cfg, str(self.args.config))
        return (f"train_gpt: params={num_params(self.model):,} world={self.world} zero={self.cfg.zero.stage} on "
                f"{self.device} precision={self.cfg.precision.dtype.value} global batch={s.global_batch_size} = micro "
                f"{s.micro_batch_size} x accumulation {self.acc.steps} x {self.world} (valid world sizes: "
                f"{batch.valid_world_sizes() if batch else 'any'}); resumed at step {start}")  # fmt: skip

    def log(self, loss: torch.Tensor, start: int, t0: float) -> None:
        """Rank 0 prints the loss averaged over the ranks (collective) and tokens/s, every 10 steps."""
        dist.all_reduce(loss)
        if self.rank == 0 and (self.step % 10 == 0 or self.step in (start + 1, self.args.steps)):
            rate = (self.step - start) * self.loader.sampler.global_batch_size * self.args.seq_len
            print(f"step {self.step:5d}/{self.args.steps}  loss {loss.item() / self.world:.4f}  "
                  f"{rate / (time.perf_counter() - t0):,.0f} tokens/s", flush=True)  # fmt: skip

    @torch.no_grad()
    def evaluate(self, global_batches: int = 2) -> None:
        """Mean loss over the eval set's first global batches: the same samples at any world size (collective)."""
        loader, acc = build_loader(self.eval_set, self.cfg, rank=self.rank, world_size=self.world, seed=self.args.seed)
        total, micro_batches = torch.zeros((), device=self.device), global_batches * acc.steps
        for x, y in itertools.islice(loader.endless(), micro_batches):
            total += self.loss(x, y).float()
        dist.all_reduce(total)
        if self.rank == 0:
            print(f"step {self.step:5d}  eval loss {total.item() / (micro_batches * self.world):.4f}", flush=True)


class LiveTrainer(Trainer):
    """The same job under ``elasticzero-run --live-recovery``: a membership change reconfigures the running workers.

    Every round (the first too) builds the model, the engine pieces and the checkpointer afresh on the round's group
    (:meth:`build`); :class:`~elasticzero.live.LiveTraining` fills them from the peers' in-memory copies (or, at the
    job's start, from the newest checkpoint: :meth:`resume`) and hands out the steps. The loop's one construct is
    ``for attempt in live.steps(n): with attempt:`` — a step left for a new round is redone there, a committed one
    never. Checkpoints stay the fallback (both copies of a shard lost, or the whole job restarted).
    """

    def __init__(self, args: argparse.Namespace) -> None:  # nothing here depends on the world: rounds build that
        self.args, self.step, self.ckpt = args, 0, None
        self.held: int | None = None  # the step this round's checkpointer saved or loaded (see checkpoint_due)
        self.device = torch.device(placement(Facts.current()).device)
        data = (stdlib_corpus(args.cache_dir, split, max_bytes=args.corpus_bytes) for split in ("train", "eval"))
        self.train_set, self.eval_set = (ByteCorpus(d, args.seq_len) for d in data)
        cfg = load_config(args.config, overrides=overrides(args), world_size=1)
        sizes = {"global_batch_size": cfg.train_batch_size, "micro_batch_size": cfg.micro_batch_size}
        self.sampler = ElasticSampler(len(self.train_set), **sizes, rank=0, world_size=1, seed=args.seed)  # re-cut
        self.copies = cfg.zero.copies  # the buddy copies (zero.copies: enabled, node_shift, overlap, early)

    def build(self, group: dist.ProcessGroup) -> torch.optim.Optimizer:
        """One round's model, pieces and checkpointer on ``group`` (the live loop calls it at every round)."""
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.cfg = load_config(self.args.config, overrides=overrides(self.args), world_size=self.world)
        if self.cfg.zero.stage == 0 or self.cfg.micro_batch_size != self.sampler.micro_batch_size:
            why = "needs zero.stage 1-3 (DDP has no shards to reshard) and one micro_batch_size at every world size"
            raise UsageError(f"{self.args.config}: --live-recovery {why}; set zero.stage and micro_batch_size")
        torch.manual_seed(self.args.seed)  # the same initial weights on every rank (a reshard overwrites them)
        self.model = GPT(config_for(self.args.size, vocab_size=256, block_size=self.args.seq_len)).to(self.device)
        self.pieces = build_pieces(self.model, self.cfg, process_group=group)
        self.net = self.pieces.wrap(self.model)
        if self.ckpt:
            self.ckpt.close()
        # a new round claims the directory: a stale rank of an old one (a frozen node resumed) can no longer write it
        directory = self.args.checkpoint_dir
        self.ckpt = directory and Checkpointer(directory, keep_last=2, process_group=group)
        self.held = None  # every member builds a fresh one: none has saved in this round yet
        return self.pieces.optimizer

    @property
    def state(self) -> dict[str, object]:  # type: ignore[override]
        """What a checkpoint holds (the same keys as the restarting trainer's: either resumes the other's)."""
        return {**self.pieces.stateful(self.model), "data": self.sampler, "rng": RNGState()}

    def resume(self, opt: torch.optim.Optimizer) -> int:
        """The job's first round (no peer holds state): the newest checkpoint, into the round's pieces and sampler."""
        self.held = self.ckpt.load_latest(self.state) if self.ckpt else None
        return self.held or 0

    def train(self) -> None:
        """Train to ``--steps`` through membership changes; checkpoint as ``--save-every`` asks; evaluate at the end."""
        args, t0 = self.args, time.perf_counter()
        refuse_unbounded(args)
        r = self.copies
        copies = {"replicate": r.enabled, "node_shift": r.node_shift, "overlap": r.overlap, "early": r.early}
        live = LiveTraining.from_agent(self.build, sampler=self.sampler, resume=self.resume, **copies)
        start = live.step
        try:
            for attempt in live.steps(args.steps):
                with attempt:
                    self.save_due(live, attempt.bounded)  # in the attempt: a peer lost in the save leaves it too
                    loss = self.live_step(attempt)
                if attempt.committed:  # else the step was left for a new round: the next attempt redoes it
                    self.end_step(live, loss, start, t0)
            self.save_last(live)
            self.evaluate()
        finally:
            live.close()
            if self.ckpt:
                self.ckpt.close()

    def end_step(self, live: LiveTraining, loss: torch.Tensor, start: int, t0: float) -> None:
        """After a committed step: log (rank 0, every 10 steps); its checkpoint is the next attempt's (``save_due``)."""
        args, self.sampler, self.step = self.args, live.sampler, live.step
        if self.rank == 0 and (self.step % 10 == 0 or self.step in (start + 1, args.steps)):
            print(f"step {self.step:5d}/{args.steps}  loss {loss.item() / self.world:.4f}  world {self.world}  "
                  f"{(self.step - start) / (time.perf_counter() - t0):.2f} steps/s", flush=True)  # fmt: skip

    def save_due(self, live: LiveTraining, run: Callable[[Callable[[], None]], bool | None]) -> bool:
        """The last committed step's checkpoint if :func:`checkpoint_due` says so, through ``run`` (DCP's collectives
        run on the round's group: a peer lost or frozen in them would otherwise stop this worker): at the start of the
        next attempt ``attempt.bounded`` (left for a new round: it raises, the attempt is redone there), after the loop
        ``live.between_steps``. Returns whether the save is still due: ``run`` returned False, having entered a new
        round, whose fresh checkpointer has not saved it."""
        if not (self.ckpt and checkpoint_due(live.step, self.args.save_every, self.args.steps, self.held)):
            return False
        self.sampler = live.sampler  # the committed step's position, re-cut if a round began meanwhile
        if run(functools.partial(self.ckpt.save, live.step, self.state)) is False:
            return True
        self.held = live.step  # on this thread, after ``run``: an abandoned save, still running, never sets it
        return False

    def save_last(self, live: LiveTraining) -> None:
        """The last step's checkpoint, after the loop, bounded like the in-loop saves: a round change during it (a peer
        lost or frozen in its collectives, a node joining) is entered and the save taken in the new round, by every
        member (:func:`checkpoint_due`: the round's step is the job's last, its fresh checkpointer has not saved it)."""
        while self.save_due(live, live.between_steps):
            pass

    def live_step(self, attempt: object) -> torch.Tensor:
        """One optimizer step over the attempt's micro-batches; the loss summed over the ranks (bounded collective)."""
        micro_batches = attempt.micro_batches  # type: ignore[attr-defined]
        acc, total = GradAccumulation(len(micro_batches)), torch.zeros((), device=self.device)
        for indices in micro_batches:
            x, y = (torch.stack(t) for t in zip(*(self.train_set[i] for i in indices), strict=True))
            with acc.no_sync(self.net, self.pieces.optimizer):
                loss = acc.scale_loss(self.loss(x, y))
                self.pieces.backward(loss)
            total += loss.detach().float()
            acc.advance()
        self.pieces.step()
        self.pieces.optimizer.communicator.all_reduce(total, tag="log")
        return total.cpu()  # synchronised inside the attempt: on NCCL a peer lost in this reduce raises here


def checkpoint_due(step: int, save_every: int, total: int, held: int | None) -> bool:
    """Whether a live job takes the checkpoint of ``step``, its last committed step, now: a save step (every
    ``save_every``, and the job's last, ``total``) that this round's checkpointer has not saved or loaded (``held``).

    A save is collective, so this decides only over what every member of the round agrees on: the round's step, and
    ``held``, which every member resets when it builds the round's checkpointer (the first round's ``resume`` sets it
    to the step loaded, on every member alike). Never a "save pending" flag carried across a round change: a survivor
    whose save was left for a new round (or announced before it began) took it there alone while the fresh joiner
    trained — mismatched collectives, the new round hung until the hang watch killed the survivor."""
    at_save_step = (save_every > 0 and step % save_every == 0) or step == total
    return step > 0 and at_save_step and step != held


def refuse_unbounded(args: argparse.Namespace) -> None:
    """:class:`UsageError` for a flag whose collectives live mode cannot bound: a peer lost in them would leave the
    survivors waiting out the collective timeout (docs/elastic-training.md, "Live recovery under the agents")."""
    if args.eval_every:  # the evaluation's all_reduce
        raise UsageError("--eval-every: not under --live-recovery (the job evaluates once, at the end)")
    if args.async_save:  # the background write's collectives, on the round's own group, beside the step's
        raise UsageError("--async-save: not under --live-recovery (its saves are synchronous and bounded); drop it")


def overrides(args: argparse.Namespace) -> list[str]:
    """The flags that override the config file, as an omegaconf dotlist."""
    flags = {"zero.stage": args.zero, "precision.dtype": args.precision, "micro_batch_size": args.micro_batch_size,
             "train_batch_size": args.global_batch_size}  # fmt: skip
    return [f"{key}={value}" for key, value in flags.items() if value is not None]


def main(argv: list[str] | None = None, trainer: type[Trainer] = Trainer, live: type[LiveTrainer] = LiveTrainer) -> int:
    args = trainer.parser().parse_args(argv)
    if ROUND_FILE_ENV in os.environ:  # elasticzero-run --live-recovery: each round forms its own group
        live(args).train()
        # a group left for a lost or frozen peer keeps a backend thread stuck in its collective until the collective
        # timeout; the interpreter's exit would wait for it (the group's destructor joins it): leave at once instead
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    device = init_distributed()  # cuda:$LOCAL_RANK over NCCL with CUDA, else cpu over gloo; alone: a world of one
    try:
        trainer(args, device).train()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    with autotune.trial():  # under elasticzero-autotune an OOM is reported as "oom", any other error as "error"
        raise SystemExit(main())
