"""ElasticSampler: world-size-independent order, exactly-once across N->M restarts, O(1) resume, clear errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from elasticzero.data import ElasticSampler, epoch_order
from elasticzero.errors import UsageError

G, N, SEED = 60, 617, 7  # 617 = 10 global batches + a 17-sample tail that no epoch uses


def make(rank: int, world: int, micro: int, **kw: object) -> ElasticSampler:
    return ElasticSampler(N, global_batch_size=G, micro_batch_size=micro, rank=rank, world_size=world, seed=SEED, **kw)


def run_phase(world: int, micro: int, steps: int, state: dict | None) -> tuple[dict, list[list[int]], list]:
    """``steps`` optimizer steps at ``world`` ranks (lock-step, like a training loop); returns the state, each
    step's global batch (all ranks' indices) and the ranks' records."""
    samplers = [make(r, world, micro, record=True) for r in range(world)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
    iters = [_endless(s) for s in samplers]
    batches = []
    for _ in range(steps):
        step: list[int] = []
        for s, it in zip(samplers, iters, strict=True):
            for _ in range(s.accumulation_steps):
                step += next(it)
                s.advance()
        batches.append(step)
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)  # rank-independent
    return states[0], batches, [x for s in samplers for x in s.record]


def _endless(s: ElasticSampler):
    while True:
        yield from s  # each pass starts at the sampler's position (the next epoch after a rollover)


@pytest.mark.parametrize(
    "phases",
    [
        [(1, 1, 3), (3, 2, 4), (5, 2, 2), (2, 3, 5), (4, 3, 3), (1, 4, 6)],  # (world, micro, steps): 23 = 2.3 epochs
        [(5, 1, 7), (2, 2, 1), (3, 5, 9), (4, 1, 6)],
    ],
)
def test_exactly_once_across_world_size_changes(phases: list[tuple[int, int, int]]) -> None:
    state, batches, records = None, [], []
    for world, micro, steps in phases:
        state, b, r = run_phase(world, micro, steps, state)
        batches += b
        records += r
    total = sum(p[2] for p in phases)
    steps_per_epoch = N // G
    for step, batch in enumerate(batches):  # the same global batches whatever the world size
        epoch, b = divmod(step, steps_per_epoch)
        assert sorted(batch) == sorted(epoch_order(N, SEED, epoch)[b * G : (b + 1) * G].tolist())
    counts = Counter(records)
    assert set(counts.values()) == {1}  # no (epoch, sample) twice
    for epoch in range(total // steps_per_epoch):  # every complete epoch covers its 600 samples exactly once
        seen = {i for e, i in counts if e == epoch}
        assert seen == set(epoch_order(N, SEED, epoch)[: steps_per_epoch * G].tolist())
    assert state == {
        "version": 1,
        "epoch": total // steps_per_epoch,
        "consumed_samples": (total % steps_per_epoch) * G,
        "seed": SEED,
        "global_batch_size": G,
        "num_samples": N,
        "shuffle": True,
    }


def test_order_is_the_seeded_permutation_and_rank_split_is_strided() -> None:
    s0, s1 = make(0, 2, 3), make(1, 2, 3)
    order = epoch_order(N, SEED, 0)
    assert torch.equal(order, epoch_order(N, SEED, 0)) and not torch.equal(order, epoch_order(N, SEED, 1))
    assert sorted(order.tolist()) == list(range(N))
    first0, first1 = next(iter(s0)), next(iter(s1))
    assert first0 == order[0:3].tolist() and first1 == order[3:6].tolist()
    assert len(s0) == 10 * G // 6 and s0.accumulation_steps == 10
    unshuffled = ElasticSampler(N, global_batch_size=G, micro_batch_size=2, rank=1, world_size=3, shuffle=False)
    assert next(iter(unshuffled)) == [2, 3]


def test_resume_is_o1_in_the_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming near the end of a 1.2M-sample epoch computes one permutation and slices one micro-batch."""
    n, g, micro, world = 1_200_000, 120, 4, 3
    saved = ElasticSampler(n, global_batch_size=g, micro_batch_size=micro, rank=0, world_size=1, seed=3)
    state = dict(saved.state_dict(), consumed_samples=9_999 * g)  # the last global batch of the epoch is next
    expected = epoch_order(n, 3, 0)[9_999 * g + 2 * micro : 9_999 * g + 3 * micro].tolist()
    perms: list[int] = []
    real_randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda k, **kw: perms.append(k) or real_randperm(k, **kw))
    s = ElasticSampler(n, global_batch_size=g, micro_batch_size=micro, rank=2, world_size=world, seed=3)
    slices: list[int] = []
    real_micro_batch = s.micro_batch
    monkeypatch.setattr(s, "micro_batch", lambda e, pos: slices.append(pos) or real_micro_batch(e, pos))
    s.load_state_dict(state)
    it = iter(s)
    first = next(it)
    assert perms == [n] and slices == [9_999 * g]  # one permutation, one slice: nothing replayed
    assert first == expected
    assert len(list(it)) == g // (micro * world) - 1 and len(perms) == 1


def test_position_moves_on_advance_not_on_draw() -> None:
    s = make(0, 2, 5)
    it = iter(s)
    drawn = [next(it) for _ in range(8)]  # a prefetching DataLoader draws ahead
    with pytest.raises(UsageError, match=r"drawn but none was marked consumed.*ElasticLoader"):
        s.state_dict()
    s.advance(6)  # one global batch of 60 = 6 micro steps of 5 x 2
    assert s.state_dict()["consumed_samples"] == 60 and len(drawn) == 8


def test_state_dict_refuses_a_position_inside_a_global_batch() -> None:
    s = make(0, 2, 5)  # a global batch is 6 micro steps of 10
    s.advance(3)
    with pytest.raises(UsageError, match=r"state_dict\(\) 30 samples into a global batch of 60: checkpoint after"):
        s.state_dict()
    s.advance(3)
    assert s.state_dict()["consumed_samples"] == 60


def test_epoch_rolls_over_after_the_last_full_global_batch() -> None:
    s = make(0, 1, 6, record=True)
    s.advance(len(s))
    assert (s.epoch, s.consumed, len(s)) == (1, 0, 100)
    assert sorted(i for _, i in s.record) == sorted(epoch_order(N, SEED, 0)[:600].tolist())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"seed": 8}, r"checkpoint's seed is 8 but this run's is 7; resuming would change the sample order"),
        ({"global_batch_size": 120}, r"checkpoint's global_batch_size is 120 but this run's is 60"),
        ({"num_samples": 600}, r"checkpoint's num_samples is 600"),
        ({"version": 9}, r"unknown state version 9"),
        ({"consumed_samples": 4}, r"position 4 is not the start of a global batch of 60 in an epoch of 10 "),
        ({"consumed_samples": 600}, r"position 600 is not the start of a global batch of 60 in an epoch of 10 "),
    ],
)
def test_load_state_dict_refuses_what_would_change_the_order(change: dict, match: str) -> None:
    state = dict(make(0, 1, 1).state_dict(), **change)
    with pytest.raises(UsageError, match=match):
        make(0, 3, 2).load_state_dict(state)


def test_dcp_style_tensor_values_are_accepted() -> None:
    state = {k: torch.tensor(v) for k, v in dict(make(0, 1, 1).state_dict(), consumed_samples=120).items()}
    s = make(1, 2, 3)
    s.load_state_dict(state)
    assert s.consumed == 120 and next(iter(s)) == epoch_order(N, SEED, 0)[123:126].tolist()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rank": 2, "world_size": 2}, r"rank 2 is not in a world of size 2"),
        ({"micro_batch_size": 7}, r"global batch 60 is not a multiple of micro batch 7 x world 2"),
        ({"num_samples": 59}, r"the dataset has 59 samples, fewer than one global batch"),
    ],
)
def test_bad_split_is_one_clear_line(kw: dict, match: str) -> None:
    args = {"num_samples": N, "global_batch_size": G, "micro_batch_size": 3, "rank": 0, "world_size": 2} | kw
    n = args.pop("num_samples")
    with pytest.raises(UsageError, match=match):
        ElasticSampler(n, **args)


def test_state_dict_survives_dcp_default_planner_shape() -> None:
    """The state is flat and made of ints/bools only (DCP saves it without pickling objects)."""
    assert all(isinstance(v, (int, bool)) for v in make(0, 1, 1).state_dict().values())
