"""A ``DataLoader`` over an :class:`~elasticzero.data.sampler.ElasticSampler` that counts what the loop received.

::

    sampler = ElasticSampler(len(ds), global_batch_size=64, micro_batch_size=4, rank=rank, world_size=world)
    loader = ElasticLoader(ds, sampler, num_workers=2)
    checkpointer.load_latest({"data": loader, ...})        # Stateful: resumes at the next global sample
    for batch in loader:                                   # the rest of the current epoch
        ...

Workers may prefetch ahead; the position moves when a batch is handed to the loop (``ElasticSampler.advance``), so
a checkpoint taken after an optimizer step names exactly the next sample, however far the workers had read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from elasticzero.data.sampler import ElasticSampler

__all__ = ["ElasticLoader"]


class ElasticLoader:
    """Iterates a ``DataLoader(dataset, batch_sampler=sampler, **kwargs)`` and advances the sampler per batch."""

    def __init__(self, dataset: Dataset[Any], sampler: ElasticSampler, **dataloader_kwargs: Any) -> None:
        self.sampler = sampler
        self.dataloader = DataLoader(dataset, batch_sampler=sampler, **dataloader_kwargs)

    def __iter__(self) -> Iterator[Any]:
        """The batches left in the current epoch; the sampler moves to the next epoch after the last one."""
        for batch in self.dataloader:
            self.sampler.advance()
            yield batch

    def __len__(self) -> int:
        return len(self.sampler)

    def endless(self) -> Iterator[Any]:
        """Batches across epochs, without end (for loops counted in optimizer steps)."""
        while True:
            yield from self

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position (``torch.distributed.checkpoint.stateful.Stateful``)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; call before iterating."""
        self.sampler.load_state_dict(state)
