"""ElasticLoader with DataLoader worker processes (num_workers=2): prefetching does not move the saved position, and
a restart at another world size continues at exactly the next sample."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils.data import Dataset

from elasticzero.data import ElasticLoader, ElasticSampler, epoch_order

N, G, SEED = 200, 24, 5


class Ids(Dataset[torch.Tensor]):
    """Sample ``i`` is the tensor ``[i]``, so a batch names its own sample ids."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def loaders(world: int, micro: int, state: dict | None) -> list[ElasticLoader]:
    out = []
    for rank in range(world):
        s = ElasticSampler(N, global_batch_size=G, micro_batch_size=micro, rank=rank, world_size=world, seed=SEED)
        loader = ElasticLoader(Ids(), s, num_workers=2, prefetch_factor=4)
        if state is not None:
            loader.load_state_dict(state)
        out.append(loader)
    return out


def train(world: int, micro: int, steps: int, state: dict | None) -> tuple[dict, list[int]]:
    """``steps`` global batches on ``world`` loaders (each with 2 prefetching workers), then stop mid-epoch."""
    group = loaders(world, micro, state)
    iters = [iter(loader) for loader in group]
    seen: list[int] = []
    for _ in range(steps):
        for loader, it in zip(group, iters, strict=True):
            for _ in range(loader.sampler.accumulation_steps):
                seen += next(it).flatten().tolist()
    states = [loader.state_dict() for loader in group]
    for it in iters:
        it.close()  # shuts the workers down
    assert all(s == states[0] for s in states)
    return states[0], seen


def test_workers_prefetch_but_the_position_counts_consumed_batches() -> None:
    state, seen_a = train(world=2, micro=3, steps=3, state=None)  # workers have read ahead of step 3
    assert state["consumed_samples"] == 3 * G
    state, seen_b = train(world=3, micro=2, steps=2, state=state)
    state, seen_c = train(world=1, micro=4, steps=3, state=state)
    assert (state["epoch"], state["consumed_samples"]) == (1, 0)  # 8 steps = the epoch (200 // 24)
    seen = seen_a + seen_b + seen_c
    assert Counter(seen).most_common(1)[0][1] == 1
    assert sorted(seen) == sorted(epoch_order(N, SEED, 0)[: 8 * G].tolist())
