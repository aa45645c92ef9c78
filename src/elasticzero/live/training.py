"""One training object for every run: a plain ``torchrun`` / ``elasticzero-run`` job and a ``--live-recovery`` one.

::

    def make_model(device):                          # a fresh model (a live survivor keeps its own instead)
        return GPT(...).to(device)

    def build(group, device, model, sync_module_states=True):  # its engine pieces on a round's group
        cfg = load_config("job.yaml", world_size=dist.get_world_size(group))
        return model, build_pieces(model, cfg, process_group=group, sync_module_states=sync_module_states)

    def loss(net, batch):                            # one micro-batch's loss (the batch already on the device)
        x, y = batch
        return lm_loss(net(x), y)

    with Training(build, loss, train_set, steps=1000, make_model=make_model, checkpoint_dir="ckpt") as training:
        for done in training:                        # every committed step once (and every evaluation)
            if training.rank == 0 and done.loss is not None:
                print(done.step, done.loss)

Without the agent's live mode (no ``$ELASTICZERO_ROUND_FILE``) the job is one static round: the default group from
``RANK``/``WORLD_SIZE`` (:func:`elasticzero.device.init_distributed`), no copies, no round watch, and a failure is
the restart path's (the agent restarts the workers; they resume from the newest checkpoint). Under
``elasticzero-run --live-recovery`` the rounds come from the agent (:class:`~elasticzero.live.loop.LiveTraining`): a
lost, frozen or joining node reconfigures the running workers. The loop is the same code in both.

What the object owns: the per-round :class:`~elasticzero.checkpoint.Checkpointer` and the save rule (:func:`due`:
every ``save_every`` steps and the last, taken by every member of a round or by none), the data (a ``DataLoader``
over the round's re-cut :class:`~elasticzero.data.ElasticSampler`, ``num_workers`` and pinned memory honoured in every
mode), the evaluation (bounded like a step), the checkpoint's state (:meth:`Training.state`: the keys of
``{model, [scaler], [scheduler], data, rng}``; at a live round change the scaler and the schedule come from a
peer, the model resharded), the gradient accumulation, the loss's reduction over the ranks, and the process's
exit (leaving a live job's process past threads stuck in abandoned groups). Hooks (:class:`Hooks`) see every
attempt's start, the save and every committed step: the test driver records through them.

Where the work of a step goes: the attempt at step N+1 first takes what is due at step N (the save, then the
evaluation) — inside the attempt, so a peer lost in their collectives leaves it for the new round like a lost step —
then trains. After the last step one more attempt takes what is due at the end (the last save, the final evaluation).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from elasticzero.checkpoint import Checkpointer, RNGState
from elasticzero.data.sampler import ElasticSampler
from elasticzero.device import Facts, init_distributed, placement
from elasticzero.engine.accumulation import GradAccumulation
from elasticzero.errors import UsageError
from elasticzero.live.loop import (
    Attempt,
    LiveTraining,
    RoundState,
    StaticTraining,
    _Rounds,
    accepts,
    release_optimizer,
)
from elasticzero.proc import leave_now
from elasticzero.progress import heartbeat
from elasticzero.rounds import ROUND_FILE_ENV

#: ``build(group, device) -> (model, pieces)``: a fresh model on ``device`` and its engine pieces
#: (:func:`elasticzero.config.build_pieces`) on ``group``, at that group's world size; or
#: ``build(group, device, model)``, which builds the pieces on ``model`` when one is given (see :class:`Training`)
Build = Callable[..., tuple[torch.nn.Module, Any]]
#: ``loss(net, batch) -> tensor``: one micro-batch's loss; ``net`` the module to run (DDP's at stage 0)
Loss = Callable[[torch.nn.Module, Any], torch.Tensor]


def takes_model(build: Callable[..., Any]) -> bool:
    """Whether ``build`` takes the model to keep (a parameter named ``model``: see :class:`Training`); a callable
    without a signature (a C builtin) has the two-argument form."""
    return accepts(build, "model")


def due(step: int, every: int, total: int, done: int | None) -> bool:
    """Whether the work of ``step`` — a checkpoint save, an evaluation: collectives — is taken now: ``step`` is one of
    its steps (every ``every``, and the job's last, ``total``) and this round has not taken it yet (``done``, the step
    it was last taken or loaded at in this round).

    It decides only over what every member of the round agrees on: the round's step, and ``done``, which every member
    resets when it enters a round (the first round's resume sets it to the step loaded, on every member alike). Never a
    "pending" flag carried across a round change: a survivor whose save was left for a new round (or announced before
    it began) took it there alone while the fresh joiner trained — mismatched collectives, the new round hung."""
    return step > 0 and ((every > 0 and step % every == 0) or step == total) and step != done


@dataclass
class Kit:
    """One round's pieces, built by :class:`Training` in the round's ``build``: the model, the module to run, the
    engine pieces, the checkpointer, and the steps this round has saved (``held``) and evaluated (``evaluated``)."""

    model: torch.nn.Module
    net: torch.nn.Module
    pieces: Any
    world: int
    rank: int
    checkpointer: Checkpointer | None
    held: int | None = None
    evaluated: int | None = None

    @property
    def optimizer(self) -> Any:
        return self.pieces.optimizer

    def carried(self) -> dict[str, Any]:
        """The world-independent engine pieces a round change carries from a peer (the pieces' ``carried()``)."""
        carried: dict[str, Any] = self.pieces.carried()
        return carried

    def count_taken_step(self) -> None:
        """A step the round's reshard counted done, counted in the pieces' scale and schedule."""
        self.pieces.count_taken_step()

    @property
    def copies_config(self) -> Any:
        """The buddy copies' settings of this round (the config's ``zero.copies``)."""
        return self.pieces.config.zero.copies


@dataclass(frozen=True)
class Done:
    """What the loop hands the user: a committed step (``loss``: the global batch's mean loss) or an evaluation after
    step ``step`` (``eval_loss``); ``samples``: this rank's ``(epoch, index)`` of the step's global batch."""

    step: int
    loss: float | None = None
    eval_loss: float | None = None
    samples: list[tuple[int, int]] = field(default_factory=list)


class Hooks:
    """Points where code outside the loop runs (each a no-op here; subclass and pass ``hooks=[...]``)."""

    def started(self, training: Training) -> None:
        """After the first round was entered and the job resumed (:attr:`Training.resumed`)."""

    def before_save(self, training: Training, attempt: Attempt) -> None:
        """At the start of every attempt, before the due work of the last committed step (its save)."""

    def before_step(self, training: Training, attempt: Attempt) -> None:
        """In every attempt after the due work (the save, the evaluation), before the step's forward."""

    def after_step(self, training: Training, done: Done) -> None:
        """After each committed step, once."""

    def checkpoint_phase(self, training: Training, phase: str, step: int) -> None:
        """Inside a checkpoint save, at each of its phases (:class:`~elasticzero.checkpoint.Checkpointer`'s
        ``phase_hook``)."""


class Training:
    """A training job in every mode (see the module). Enter it (``with``), iterate it for the committed steps.

    Args:
        build: ``build(group, device) -> (model, pieces)``, called once per round (once in a plain run). A build that
            takes a third parameter named ``model`` — ``build(group, device, model=None)`` — keeps the model across
            a live round change: ``model`` is None where the process makes its first model, else its model of the
            round it leaves (its optimizer released from it; the reshard then overwrites its parameters): build the
            pieces on it instead of a new model (used at stages 1/2 with fp32 parameters; else ``model`` is None).
            A build that takes a keyword ``sync_module_states`` gets False where a live round's members hold state
            — the round's reshard writes every member's model state — and passes it on to
            :func:`~elasticzero.config.build_pieces` (the engine's broadcast of the module from rank 0, the
            parameters' bytes again, is left out; a build without it broadcasts on every rank, as before).
        loss: ``loss(net, batch)``, one micro-batch's loss (the batch moved to the device).
        dataset: the training set (a map-style ``Dataset``: the sampler picks indices).
        steps: optimizer steps in total.
        seed: the data order's seed.
        checkpoint_dir, save_every, async_save, keep_last: the checkpoints (``save_every`` 0: only the
            last step's; ``async_save`` refused under live recovery: its background collectives cannot be bounded).
        eval_dataset, eval_every, eval_batches: the evaluation — the mean loss over the eval set's first
            ``eval_batches`` global batches (the same samples at any world size), every ``eval_every`` steps and at
            the end.
        num_workers: ``DataLoader`` worker processes per rank (memory is pinned on CUDA).
        hooks: :class:`Hooks`.
        make_model: ``make_model(device) -> model``: where given, the model every build is handed where it makes one
            (the build must take ``model``); a process's first model is made before its first round's group is
            formed — a node joining a live job makes it while the running members train on at the old world (they
            switch when its formation starts), not while they wait for it.
        env: the environment to read (default ``os.environ``).
        leave_process: on a clean end of a live job, leave the process at once (``os._exit(0)``: threads stuck in
            abandoned groups would hold the interpreter's exit); False for a caller that goes on (tests).
        live_options: more :class:`~elasticzero.live.loop.LiveTraining` options (``poll_s``, ``failure_grace_s``,
            ``nodes``, ...).
    """

    def __init__(
        self,
        build: Build,
        loss: Loss,
        dataset: Dataset[Any],
        *,
        steps: int,
        seed: int = 0,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        save_every: int = 0,
        async_save: bool = False,
        keep_last: int = 2,
        eval_dataset: Dataset[Any] | None = None,
        eval_every: int = 0,
        eval_batches: int = 2,
        num_workers: int = 0,
        hooks: Sequence[Hooks] = (),
        make_model: Callable[[torch.device], torch.nn.Module] | None = None,
        env: Mapping[str, str] | None = None,
        leave_process: bool = True,
        live_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.user_build, self.loss, self.dataset, self.total, self.seed = build, loss, dataset, steps, seed
        self.checkpoint_dir, self.save_every, self.async_save = checkpoint_dir, save_every, async_save
        self.keep_last, self.eval_dataset, self.eval_every = keep_last, eval_dataset, eval_every
        self.eval_batches = eval_batches
        self.num_workers, self.hooks, self.leave_process = num_workers, tuple(hooks), leave_process
        self.env = os.environ if env is None else env
        self.live = ROUND_FILE_ENV in self.env
        self.live_options = dict(live_options or {})
        self.device = torch.device(placement(Facts.current(self.env)).device)
        self.resumed, self.load_s, self.stopped = 0, 0.0, False
        self._template: ElasticSampler | None = None
        self._stream: tuple[RoundState | None, Iterator[Any]] = (None, iter(()))
        self._own_group = False
        self._last: tuple[float, list[tuple[int, int]]] | None = None  # the step in flight's loss and samples
        self.make_model = make_model
        self._prepared: torch.nn.Module | None = None  # made before the first round's group (make_model)
        if make_model is not None and not takes_model(build):
            raise UsageError("Training(make_model=...): the build must take the model it makes: "
                             "def build(group, device, model)")  # fmt: skip
        if self.live and async_save:
            raise UsageError("async_save (--async-save): not under --live-recovery (its saves are synchronous and "
                             "bounded); drop it")  # fmt: skip

    # -- the rounds -------------------------------------------------------------------------------------------------
    def __enter__(self) -> Training:
        """Enter the first round: form its group (a plain run: ``init_distributed``), build, resume."""
        self.rounds: _Rounds = self._live() if self.live else self._static()
        self.resumed = self.rounds.step
        for hook in self.hooks:
            hook.started(self)
        return self

    def _static(self) -> StaticTraining:
        if not dist.is_initialized():
            self.device, self._own_group = init_distributed(), True
        return StaticTraining(self._build, sampler=self._sampler, group=dist.group.WORLD, resume=self._resume)

    @property
    def _build_syncs(self) -> bool:
        """Whether the user's build takes ``sync_module_states`` (passed to ``build_pieces``: see :class:`Training`)."""
        return accepts(self.user_build, "sync_module_states")

    @property
    def keeps_model(self) -> bool:
        """Whether the build takes the model to keep (``build(group, device, model=None)``): a live survivor's model is
        handed back to it."""
        return takes_model(self.user_build)

    def _live(self) -> LiveTraining:
        rebuild = self._build if self.keeps_model else None  # the survivors keep their model
        options = {"rebuild": rebuild, "prepare": self._prepare, "end": self.total, **self.live_options}
        return LiveTraining.from_agent(self._build, sampler=self._sampler, env=self.env, resume=self._resume, **options)

    def _build(self, group: Any, kept: torch.nn.Module | None = None, sync_module_states: bool = True) -> Kit:
        """One round's kit: the user's model and pieces on ``group`` (on ``kept``, a survivor's model, where given),
        the round's checkpointer (a new round claims the directory: a stale rank of an old one — a frozen node
        resumed — can no longer write it). ``sync_module_states`` False (a live round whose reshard writes the
        models' state) is passed on where the user's build takes it."""
        model = kept if kept is not None else self._take_prepared()
        args = (model,) if self.keeps_model else ()
        sync = {} if sync_module_states else {"sync_module_states": False}
        model, pieces = self.user_build(group, self.device, *args, **(sync if self._build_syncs else {}))
        try:
            return self._kit(group, model, pieces)
        except BaseException:  # the optimizer's hooks off the model: a later try wraps it again
            release_optimizer(pieces.optimizer)
            raise

    def _kit(self, group: Any, model: torch.nn.Module, pieces: Any) -> Kit:
        """The kit of what the user's build made: checked for a live round, with the round's checkpointer (a
        collective: it claims the directory)."""
        if self.live:
            self._check_live(pieces)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        directory, ckpt = self.checkpoint_dir, None
        if directory is not None:
            options = {"keep_last": self.keep_last, "async_save": self.async_save, "phase_hook": self._phase}
            # live: the round's group (its saves are synchronous, bounded); plain: a gloo group of its own (None),
            # which a background write may use while the steps' collectives run on the default group
            ckpt = Checkpointer(directory, process_group=group if self.live else None, **options)
        return Kit(model, pieces.wrap(model), pieces, world, rank, ckpt)

    def _prepare(self) -> None:
        """Before the first round's group (:class:`LiveTraining`'s ``prepare``): the model, where ``make_model`` is
        given — a joiner makes it while its running peers train on."""
        self._prepared = self._new_model()

    def _new_model(self) -> torch.nn.Module | None:
        """A model of ``make_model``'s (None without it: the build makes its own)."""
        return self.make_model(self.device) if self.make_model is not None else None

    def _take_prepared(self) -> torch.nn.Module | None:
        """The model made before the first round's group, once; afterwards a new one (an entry thrown away took it)."""
        model, self._prepared = self._prepared, None
        return model if model is not None else self._new_model()

    def _phase(self, phase: str, step: int) -> None:
        for hook in self.hooks:
            hook.checkpoint_phase(self, phase, step)

    def _check_live(self, pieces: Any) -> None:
        if pieces.config.zero.stage == 0:
            raise UsageError("elasticzero-run --live-recovery: zero.stage 0 (DDP) has no shards to reshard in "
                             "memory; set zero.stage 1-3 in the config, or run without --live-recovery")  # fmt: skip
        if self._template is not None and pieces.micro_batch_size != self._template.micro_batch_size:
            raise UsageError(f"--live-recovery: micro_batch_size {pieces.micro_batch_size} at this world, "
                             f"{self._template.micro_batch_size} at the first: set one micro_batch_size")  # fmt: skip

    def _sampler(self, kit: Kit) -> ElasticSampler:
        """The job's sampler at its start (rank 0 of a world of one: each round re-cuts it), from the first kit."""
        micro = kit.pieces.micro_batch_size
        glob = micro * kit.pieces.accumulation_steps * kit.world
        size = len(self.dataset)  # type: ignore[arg-type]
        self._template = ElasticSampler(
            size, global_batch_size=glob, micro_batch_size=micro, rank=0, world_size=1, seed=self.seed
        )
        return self._template

    def _resume(self, kit: Kit, sampler: ElasticSampler) -> int:
        """The job's first round (no peer holds state): the newest checkpoint into the kit and the sampler."""
        t0 = time.perf_counter()
        step = kit.checkpointer.load_latest(self.state(kit, sampler)) if kit.checkpointer else None
        self.load_s = time.perf_counter() - t0
        kit.held = kit.evaluated = step
        return step or 0

    @staticmethod
    def state(kit: Kit, sampler: ElasticSampler) -> dict[str, Any]:
        """What a checkpoint holds: the pieces' (model, optimizer, [scaler], [scheduler]), the data position, the
        RNG."""
        return {**kit.pieces.stateful(kit.model), "data": sampler, "rng": RNGState()}

    # -- what the user reads ------------------------------------------------------------------------------------------
    @property
    def kit(self) -> Kit:
        kit: Kit = self.rounds.built
        return kit

    @property
    def step(self) -> int:
        """The last committed step."""
        return self.rounds.step

    @property
    def rank(self) -> int:
        return self.kit.rank

    @property
    def world(self) -> int:
        return self.kit.world

    @property
    def model(self) -> torch.nn.Module:
        return self.kit.model

    @property
    def pieces(self) -> Any:
        return self.kit.pieces

    @property
    def sampler(self) -> ElasticSampler:
        return self.rounds.sampler

    @property
    def events(self) -> list[Any]:
        """The rounds this process entered live (:class:`~elasticzero.live.loop.RoundEvent`)."""
        return self.rounds.events

    def bounded(self, work: Callable[[], None]) -> bool:
        """Run collectives of the round's group outside the engine, bounded (:meth:`LiveTraining.bounded`)."""
        return self.rounds.bounded(work)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Done]:
        """Train to ``steps``: every committed step once, every evaluation once (see the module)."""
        while not self.stopped and self.step < self.total:
            attempt = Attempt(self.rounds)
            found: list[Done] = []
            with attempt:
                self._due(attempt, found)
                self._train_step(attempt)
            yield from found
            if attempt.committed:  # by this attempt, or by the reshard of the round it left after the gate
                yield self._committed(attempt.number + 1)
        yield from self._finish()

    def _committed(self, step: int) -> Done:
        loss, samples = self._last if self._last is not None else (None, [])
        done = Done(step, loss=loss, samples=samples)
        self.stopped = bool(self.pieces.timers.count(samples=self.sampler.global_batch_size // self.world))
        for hook in self.hooks:
            hook.after_step(self, done)
        return done

    def _finish(self) -> Iterator[Done]:
        """The work due after the last step (its save, the final evaluation), attempted until done in one round."""
        while not self.stopped:
            attempt, found = Attempt(self.rounds, commits=False), list[Done]()
            with attempt:
                self._due(attempt, found)
            yield from found
            if attempt.completed:
                return

    def _due(self, attempt: Attempt, found: list[Done]) -> None:
        """At the start of an attempt: the save, then the evaluation, of the last committed step if due."""
        for hook in self.hooks:
            hook.before_save(self, attempt)
        kit, step = self.kit, self.step
        if kit.checkpointer is not None and due(step, self.save_every, self.total, kit.held):
            ckpt, state = kit.checkpointer, self.state(kit, self.sampler)
            self.bounded(lambda: ckpt.save(step, state))  # DCP's collectives: a lost peer leaves the attempt
            kit.held = step  # after the save returned on this thread: an abandoned save never sets it
        if self.eval_dataset is not None and due(step, self.eval_every, self.total, kit.evaluated):
            found.append(Done(step, eval_loss=self._evaluate(kit)))
            kit.evaluated = step
        for hook in self.hooks:
            hook.before_step(self, attempt)

    def _train_step(self, attempt: Attempt) -> None:
        """One optimizer step over the attempt's micro-batches. The global batch's mean loss (reduced over the ranks
        before the step's commit gate: a step a reshard counts done has it too) and this rank's samples: ``_last``."""
        kit, sampler, self._last = self.kit, self.sampler, None
        samples = [(sampler.epoch, i) for mb in attempt.micro_batches for i in mb]
        batches = self._batches()
        acc, total = GradAccumulation(sampler.accumulation_steps), torch.zeros((), device=self.device)
        for _ in range(acc.steps):
            batch = _to(next(batches), self.device)
            with acc.no_sync(kit.net, kit.optimizer):
                with kit.pieces.autocast():
                    loss = acc.scale_loss(self.loss(kit.net, batch))
                kit.pieces.backward(loss)
            total += loss.detach().float()
            acc.advance()
        self._all_reduce(total)
        self._last = (float(total.item()) / kit.world, samples)  # on NCCL a peer lost in the reduce raises here
        kit.pieces.step()

    def _all_reduce(self, t: torch.Tensor) -> None:
        comm = getattr(self.kit.optimizer, "communicator", None)
        if comm is not None:
            comm.all_reduce(t, tag="log")  # the engine's communicator: bounded in a live round
        else:
            dist.all_reduce(t)

    def _batches(self) -> Iterator[Any]:
        """The round's micro-batches from its sampler's position on, through a ``DataLoader`` (made again at every
        round: the sampler is re-cut; within a round every attempt takes the next global batch)."""
        now = self.rounds.now
        if self._stream[0] is not now:
            self._stream = (now, _endless(self._loader(self.dataset, now.sampler)))
        return self._stream[1]

    def _loader(self, dataset: Dataset[Any], sampler: ElasticSampler) -> DataLoader[Any]:
        pin = self.device.type == "cuda"
        return DataLoader(dataset, batch_sampler=sampler, num_workers=self.num_workers, pin_memory=pin)

    @torch.no_grad()
    def _evaluate(self, kit: Kit) -> float:
        """Mean loss over the eval set's first global batches: the same samples at any world size (a collective,
        bounded like the step's; told to the agent as progress, a pause of the loop's own)."""
        heartbeat()
        assert self._template is not None and self.eval_dataset is not None
        t = self._template
        size = len(self.eval_dataset)  # type: ignore[arg-type]
        s = ElasticSampler(size, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                           rank=kit.rank, world_size=kit.world, seed=self.seed)  # fmt: skip
        micro_batches = self.eval_batches * s.accumulation_steps
        total = torch.zeros((), device=self.device)
        for batch in itertools.islice(_endless(self._loader(self.eval_dataset, s)), micro_batches):
            with kit.pieces.autocast():
                total += self.loss(kit.net, _to(batch, self.device)).float()
        self._all_reduce(total)
        heartbeat()
        return float(total.item()) / (micro_batches * kit.world)

    # -- the end ----------------------------------------------------------------------------------------------------
    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Close the round's copies and checkpointer (an error too: no background save is left running); a plain
        run's group is destroyed, a live job's process left at once on a clean end (see ``leave_process``)."""
        rounds, (_, stream) = getattr(self, "rounds", None), self._stream
        self._stream = (None, iter(()))
        if hasattr(stream, "close"):
            stream.close()  # the DataLoader's worker processes stop now (leave_now below would leave them running)
        try:
            if rounds is not None:
                rounds.close()
                if self.kit.checkpointer is not None:
                    self.kit.checkpointer.close()
        finally:
            if self._own_group and dist.is_initialized():
                dist.destroy_process_group()
        if self.live and exc is None and self.leave_process:
            leave_now(0)


def _endless(loader: DataLoader[Any]) -> Iterator[Any]:
    """A loader's batches across epochs (each pass starts at its sampler's position then)."""
    while True:
        yield from loader


def _to(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or a tuple/list/dict of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, list | tuple):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch
