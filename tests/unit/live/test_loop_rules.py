"""The loop's pure rules: the new group's ranks from a round, the sampler re-cut at another world size."""

from __future__ import annotations

import pytest

from elasticzero.data.sampler import ElasticSampler
from elasticzero.live.bounded import LiveError
from elasticzero.live.loop import new_group_ranks, resampled
from elasticzero.live.rounds import Round


def test_the_new_group_is_the_members_default_group_ranks_in_order() -> None:
    assert new_group_ranks(Round(1, ((0, 0), (2, 1)), "r1/"), [4, 5, 6]) == [4, 6]


@pytest.mark.parametrize("members", [((2, 0), (0, 1)), ((0, 0), (3, 1))])
def test_a_reordering_or_unknown_member_is_a_live_error(members: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(LiveError, match="round 1"):
        new_group_ranks(Round(1, members, "r1/"), [0, 1, 2])


def test_the_resampled_world_takes_the_same_global_batches() -> None:
    def sampler(rank: int, world: int) -> ElasticSampler:
        return ElasticSampler(48, global_batch_size=12, micro_batch_size=2, rank=rank, world_size=world, seed=3)

    old = [sampler(r, 3) for r in range(3)]
    for s in old:
        s.advance(2 * s.accumulation_steps)  # two global batches committed at world 3
    new = [resampled(old[0], r, 2) for r in range(2)]
    want = [sampler(0, 1).micro_batch(0, 24 + i) for i in range(0, 12, 2)]
    got = [s.micro_batch(s.epoch, s.consumed + p) for p in range(0, 12, 4) for s in new]
    assert sorted(i for mb in got for i in mb) == sorted(i for mb in want for i in mb)
    assert all(s.consumed == 24 and s.world_size == 2 and s.accumulation_steps == 3 for s in new)
