"""A distributed batch sampler whose global sample order does not depend on the world size, resumable at any size.

The order of an epoch is one seeded permutation of the dataset (``torch.randperm`` with a ``torch.Generator`` seeded
``seed + epoch``), the same on every process. Global batch ``b`` is the slice ``order[b*G:(b+1)*G]``; it is walked in
micro steps of ``micro * world`` samples, and rank ``r`` takes the ``r``-th ``micro``-sized piece of each micro step::

    global batch b:  | step 0: r0 r1 .. r(W-1) | step 1: r0 r1 .. | ... | step A-1 |     A = G / (micro * W)

So the samples consumed so far are always a prefix of the epoch's order, and the position is one integer (global
samples consumed in this epoch). A restart at another world size reads that integer, computes the epoch's permutation
once, and slices from there: O(1) in the position, nothing is replayed. The last ``len(dataset) % G`` samples of
each epoch's order are not used in that epoch (every global batch is full).

The position moves only when the training loop *receives* a micro-batch (:meth:`ElasticSampler.advance`, called by
:class:`~elasticzero.data.loader.ElasticLoader`), never when ``__iter__`` hands indices to DataLoader workers that
prefetch ahead; ``state_dict()`` refuses to describe a sampler that was iterated but never advanced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Sampler

from elasticzero.errors import UsageError

__all__ = ["ElasticSampler", "epoch_order"]

STATE_VERSION = 1


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of ``epoch``: a permutation of ``range(num_samples)`` that depends only on its arguments."""
    if not shuffle:
        return torch.arange(num_samples)
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=gen)


class ElasticSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices) from the current position to the end of the epoch.

    Use it through :class:`~elasticzero.data.loader.ElasticLoader` (which calls :meth:`advance` for every batch the
    loop receives), or pass it as ``batch_sampler=`` to a ``DataLoader`` and call :meth:`advance` once per
    micro-batch you train on. ``record=True`` keeps ``(epoch, index)`` of every sample this rank consumed (tests).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        record: bool = False,
    ) -> None:
        _check_split(num_samples, global_batch_size, micro_batch_size, rank, world_size)
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.consumed = 0  # global samples of this epoch the training loop has received (all ranks together)
        self.record: list[tuple[int, int]] | None = [] if record else None
        self._cached: tuple[int, torch.Tensor] | None = None
        self._drawn = self._advanced = 0

    # ------------------------------------------------------------------------------------------ geometry
    @property
    def micro_step(self) -> int:
        """Global samples per micro step (one micro-batch on every rank)."""
        return self.micro_batch_size * self.world_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank per global batch."""
        return self.global_batch_size // self.micro_step

    @property
    def steps_per_epoch(self) -> int:
        """Global batches (optimizer steps) per epoch."""
        return self.num_samples // self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches this rank has left in the current epoch."""
        return (self.steps_per_epoch * self.global_batch_size - self.consumed) // self.micro_step

    # ------------------------------------------------------------------------------------------ indices
    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's global order (computed once per epoch and cached)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_order(self.num_samples, self.seed, epoch, self.shuffle))
        return self._cached[1]

    def micro_batch(self, epoch: int, position: int) -> list[int]:
        """This rank's indices in the micro step that starts at global sample ``position`` of ``epoch``."""
        start = position + self.rank * self.micro_batch_size
        return self.order(epoch)[start : start + self.micro_batch_size].tolist()

    def __iter__(self) -> Any:
        epoch, start = self.epoch, self.consumed  # a snapshot: drawing (prefetching) never moves the position
        for position in range(start, self.steps_per_epoch * self.global_batch_size, self.micro_step):
            self._drawn += 1
            yield self.micro_batch(epoch, position)

    # ------------------------------------------------------------------------------------------ position
    def advance(self, micro_batches: int = 1) -> None:
        """Mark ``micro_batches`` micro steps as consumed by the training loop (every rank calls this alike)."""
        for _ in range(micro_batches):
            if self.record is not None:
                self.record.extend((self.epoch, i) for i in self.micro_batch(self.epoch, self.consumed))
            self.consumed += self.micro_step
            self._advanced += 1
            if self.consumed >= self.steps_per_epoch * self.global_batch_size:
                self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Position and the settings it depends on; independent of rank, world size and micro batch size."""
        if self._drawn and not self._advanced:
            raise UsageError(
                "ElasticSampler: batches were drawn but none was marked consumed, so the position would be lost: "
                "iterate through elasticzero.data.ElasticLoader, or call sampler.advance() per micro-batch trained on"
            )
        if self.consumed % self.global_batch_size:
            raise UsageError(
                f"ElasticSampler: state_dict() {self.consumed % self.global_batch_size} samples into a global batch "
                f"of {self.global_batch_size}: checkpoint after the optimizer step, when the global batch is complete"
            )
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed_samples": self.consumed,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position, at this sampler's (possibly different) world size and micro batch size."""
        state = {k: _plain(v) for k, v in state.items()}
        for key in ("seed", "global_batch_size", "num_samples", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise UsageError(
                    f"ElasticSampler: the checkpoint's {key} is {state.get(key)!r} but this run's is "
                    f"{getattr(self, key)!r}; resuming would change the sample order (use the saved value)"
                )
        if state.get("version") != STATE_VERSION:
            raise UsageError(f"ElasticSampler: unknown state version {state.get('version')!r} (this build: 1)")
        consumed = int(state["consumed_samples"])
        if consumed % self.global_batch_size or not 0 <= consumed < self.steps_per_epoch * self.global_batch_size:
            raise UsageError(
                f"ElasticSampler: the checkpoint's position {consumed} is not the start of a global batch of "
                f"{self.global_batch_size} in an epoch of {self.steps_per_epoch} (checkpoint after optimizer steps)"
            )
        self.epoch, self.consumed = int(state["epoch"]), consumed


def _check_split(num_samples: int, global_batch: int, micro: int, rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"ElasticSampler: rank {rank} is not in a world of size {world}")
    if micro < 1 or global_batch % (micro * world):
        raise UsageError(
            f"ElasticSampler: global batch {global_batch} is not a multiple of micro batch {micro} x world {world}"
        )
    if num_samples < global_batch:
        raise UsageError(f"ElasticSampler: the dataset has {num_samples} samples, fewer than one global batch")


def _plain(value: Any) -> Any:
    """A 0-d tensor (as DCP may hand back) as a Python number."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
