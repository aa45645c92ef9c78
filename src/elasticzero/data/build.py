"""One builder for the two things that must agree: the sampler's batch geometry and the gradient accumulation.

::

    loader, acc = build_loader(dataset, cfg, rank=rank, world_size=world, seed=1234, num_workers=2)
    for x, y in loader.endless():
        with acc.no_sync(model, opt):
            ...
        if acc.advance():                   # every acc.steps micro-batches: one global batch of the sampler
            ...

Both come from one :class:`~elasticzero.config.elastic.BatchPlan` (:func:`~elasticzero.config.elastic.batch_plan`,
the plan ``build_pieces`` builds with), so an optimizer step consumes exactly one global batch of the sampler's order
at every world size.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from elasticzero.config.elastic import batch_plan
from elasticzero.config.schema import EngineConfig
from elasticzero.data.loader import ElasticLoader
from elasticzero.data.sampler import ElasticSampler
from elasticzero.engine.accumulation import GradAccumulation

__all__ = ["build_loader"]


def build_loader(
    dataset: Dataset[Any], cfg: EngineConfig, *, rank: int, world_size: int, seed: int = 0, **dataloader_kwargs: Any
) -> tuple[ElasticLoader, GradAccumulation]:
    """An :class:`ElasticLoader` over ``dataset`` for this rank and the :class:`GradAccumulation` of its global batch.

    ``cfg``'s plan at ``world_size`` sets the global and micro batch (a :class:`~elasticzero.errors.UsageError` names
    the valid world sizes when there is none); ``seed`` the sample order; ``dataloader_kwargs`` go to the
    ``DataLoader`` (``num_workers``, ``pin_memory``, ...)."""
    plan = batch_plan(cfg, world_size)
    sampler = ElasticSampler(
        len(dataset),  # type: ignore[arg-type]
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.micro_batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
    )
    return ElasticLoader(dataset, sampler, **dataloader_kwargs), GradAccumulation(sampler.accumulation_steps)
