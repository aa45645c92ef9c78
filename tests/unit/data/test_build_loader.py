"""build_loader: the sampler and the gradient accumulation come from one batch plan, so each optimizer step (the
accumulation's boundary) consumes exactly one global batch of the sampler's order, at every world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import TensorDataset

from elasticzero.config.load import config_from_dict
from elasticzero.data import build_loader, epoch_order
from elasticzero.errors import UsageError

N, SEED = 100, 5
ELASTIC = {"elasticity": {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 4]}}
FIXED = {"train_batch_size": 16, "micro_batch_size": 4}


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N))


def _first_step(data: dict, world: int) -> tuple[Counter[int], int]:
    """All ranks' samples up to the accumulation's first boundary, and the accumulation steps."""
    cfg = config_from_dict(data, world_size=world)
    samples: Counter[int] = Counter()
    for rank in range(world):
        loader, acc = build_loader(_dataset(), cfg, rank=rank, world_size=world, seed=SEED)
        assert loader.sampler.accumulation_steps == acc.steps and loader.sampler.world_size == world
        for (batch,) in loader:
            samples.update(batch.tolist())
            if acc.advance():
                break
    return samples, acc.steps


@pytest.mark.parametrize(("data", "global_batch", "worlds"), [(ELASTIC, 24, (1, 2, 3, 4, 6)), (FIXED, 16, (1, 2, 4))])
def test_one_optimizer_step_is_one_global_batch_at_every_world_size(
    data: dict, global_batch: int, worlds: tuple[int, ...]
) -> None:
    first = Counter(epoch_order(N, SEED, 0)[:global_batch].tolist())
    steps = {}
    for world in worlds:
        samples, steps[world] = _first_step(data, world)
        assert samples == first, world
    assert len(set(steps.values())) > 1  # the accumulation did follow the world size


def test_a_world_without_plan_fails_before_anything_is_built() -> None:
    cfg = config_from_dict(FIXED, world_size=2)
    with pytest.raises(UsageError, match="contradictory batch sizes"):
        build_loader(_dataset(), cfg, rank=0, world_size=3)
    with pytest.raises(UsageError, match="world size 5 has no batch plan"):
        build_loader(_dataset(), config_from_dict(ELASTIC), rank=0, world_size=5)
