"""Communicator on a world-size-1 gloo group: per-object stats and settle lists, close, replacing an optimizer's
communicator, the ring decision, and where the default group is unpinned.

Two and three ranks (rings, replacement under training, a group of another size) are in
``tests/integration/engine/test_comm.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn_functional
from torch import nn

from elasticzero import GradBucketer, ZeroStage2, ZeroStage3
from elasticzero.engine.zero import comm
from elasticzero.engine.zero.comm import CommStats, Communicator, ring_applies
from elasticzero.errors import UsageError

pytestmark = pytest.mark.timeout(60)


def test_each_communicator_counts_only_its_own_collectives(group: None) -> None:
    a, b = Communicator(owner="a"), Communicator(owner="b")
    a.all_reduce(torch.ones(5))
    a.broadcast(torch.ones(3), 0)
    b.all_gather(torch.empty(4), torch.ones(4), tag="state_dict")
    assert dict(a.stats.elements) == {("all_reduce", "grad"): 5, ("broadcast", "init"): 3}
    assert dict(b.stats.elements) == {("all_gather", "state_dict"): 4}
    total = sum((a.stats, b.stats), CommStats())
    assert total.snapshot() == {"all_reduce:grad": 5, "broadcast:init": 3, "all_gather:state_dict": 4}
    assert total.calls == a.stats.calls + b.stats.calls and total.bytes[("all_reduce", "grad")] == 5 * 4


def test_an_optimizer_and_its_bucketer_share_one_communicator(group: None) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = ZeroStage2(model, torch.optim.SGD, lr=0.1)
    assert opt.bucketer.communicator is opt.communicator and opt.comm_stats is opt.communicator.stats
    init = opt.comm_stats.snapshot()  # the construction broadcast
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    step = {k: n - init.get(k, 0) for k, n in opt.comm_stats.snapshot().items()}
    padded = sum(bk.padded_numel for bk in opt.buckets)
    assert step == {**dict.fromkeys(init, 0), "reduce_scatter:grad": padded, "all_gather:param": padded}
    other = GradBucketer(nn.Linear(4, 4).parameters())
    assert other.communicator is not opt.communicator and other.comm_stats.snapshot() == {}


def test_settle_lists_are_per_communicator(group: None) -> None:
    a, b = Communicator(), Communicator()
    work = a.all_reduce(torch.ones(8), async_op=True)
    assert work is not None and a.pending == 1 and b.pending == 0
    work.wait()
    assert work.done and a.pending == 0
    assert a.unsettled == 1 and b.unsettled == 0  # the alias waits for a's settle, not b's
    b.settle()
    assert a.unsettled == 1
    a.settle()
    assert a.unsettled == 0


def test_close_completes_pending_work_then_refuses_use(group: None) -> None:
    c = Communicator(owner="GradBucketer")
    t = torch.full((6,), 2.0)
    work = c.all_reduce(t, async_op=True)
    assert work is not None and not work.done
    c.close()
    assert work.done and c.closed and c.pending == 0 and c.unsettled == 0
    torch.testing.assert_close(t, torch.full((6,), 2.0))  # world size 1: the sum is the tensor itself
    c.close()  # idempotent
    with pytest.raises(UsageError, match="communicator of this GradBucketer was closed"):
        c.all_reduce(t)
    with pytest.raises(UsageError, match="was closed"):
        c.group  # noqa: B018 - the property is what is tested
    assert c.stats.calls[("all_reduce", "grad")] == 1  # the refused call was not counted


def test_destroyed_group_is_one_clear_error(group: None) -> None:
    pg = dist.new_group([0])
    c = Communicator(pg, owner="ZeroStage1")
    dist.destroy_process_group(pg)
    del pg
    gc.collect()
    with pytest.raises(UsageError, match=r"ZeroStage1 was destroyed \(destroy_process_group\)"):
        c.all_reduce(torch.ones(1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        x = torch.linspace(-1.0, 1.0, 8 * 6).reshape(8, 6) * (i + 1)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("stage_cls", [ZeroStage2, ZeroStage3])
def test_replaced_communicator_on_a_new_group_keeps_the_optimizer_training(group: None, stage_cls: type) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
        return model, stage_cls(model, torch.optim.AdamW, lr=1e-2, process_group=dist.new_group([0]))

    ref_model, ref_opt = build()
    _train(ref_model, ref_opt, range(4))
    model, opt = build()
    _train(model, opt, range(2))
    old, old_group = opt.communicator, opt.process_group
    opt.communicator = Communicator(dist.new_group([0]), owner=stage_cls.__name__)
    assert old.closed and opt.bucketer.communicator is opt.communicator
    dist.destroy_process_group(old_group)  # the optimizer no longer refers to it
    del old_group
    _train(model, opt, range(2, 4))
    assert opt.comm_stats.total_elements() > 0 and opt.comm_stats is not old.stats
    ref, got = ref_opt.full_state_dict(), opt.full_state_dict()
    for k in ref:  # same ranks, same collectives on either group: bitwise the same training
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)


def test_replacement_must_be_open(group: None) -> None:
    opt = ZeroStage2(nn.Linear(3, 3), torch.optim.SGD, lr=0.1)
    closed = Communicator()
    closed.close()
    with pytest.raises(UsageError, match="the new communicator is closed"):
        opt.communicator = closed
    assert not opt.communicator.closed  # nothing replaced, nothing closed
    counted = opt.comm_stats.snapshot()  # the construction broadcast
    opt.communicator = Communicator(dist.new_group([0]), stats=opt.comm_stats)  # keeps counting into the same counters
    assert opt.comm_stats.snapshot() == counted and opt.bucketer.comm_stats is opt.comm_stats
    with pytest.raises(UsageError, match="communicator= brings its group and stats"):
        GradBucketer(nn.Linear(2, 2).parameters(), communicator=opt.communicator, comm_stats=CommStats())


def test_ring_decision() -> None:
    assert ring_applies("gloo", 2, None) and ring_applies("gloo", 3, "1")
    assert not ring_applies("gloo", 2, "0")  # ELASTICZERO_GLOO_RING=0
    assert not ring_applies("gloo", 1, None)  # one rank: nothing to exchange
    assert not ring_applies("nccl", 2, None)


def test_ring_decision_is_made_when_the_communicator_is_built(group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICZERO_GLOO_RING", "0")
    c = Communicator()
    assert c.uses_ring is False and c.backend == "gloo" and (c.rank, c.size) == (0, 1)


def test_a_communicator_on_the_default_group_unpins_it(group: None) -> None:
    world = dist.group.WORLD
    saved = dist_nn_functional.broadcast.__defaults__
    dist_nn_functional.broadcast.__defaults__ = (world,)  # what importing the module after init_process_group binds
    try:
        Communicator(dist.new_group([0]))  # a subgroup: torch's defaults never hold it, left alone
        assert comm.default_group_pinned()
        Communicator()
        assert not comm.default_group_pinned()
        assert dist_nn_functional.broadcast.__defaults__ == (None,)
    finally:
        dist_nn_functional.broadcast.__defaults__ = saved
