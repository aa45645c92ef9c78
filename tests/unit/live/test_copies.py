"""The BuddyCopies's pure pieces (live/copies.py) and its off path on a one-rank group: one node means no
copies, no exchange, nothing sent, and the holdings are this rank's own live state at the step it is at (the census
counts its own steps: a live job's reshard resumes from it); holdings taken before the first step reshard into an
optimizer that then trains exactly as a fresh one (a node joined or left before step 1)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.zero import clip
from elasticzero.engine.zero.watch import Factor
from elasticzero.live.copies import (
    MAX_FACTORS,
    BuddyCopies,
    WardCopy,
    early_grads_usable,
    grad_message,
    node_key,
    note_of,
)
from elasticzero.live.reshard import ReshardPlan, Seed, reshard_from


def test_node_key_prefers_torchelastic_node_rank() -> None:
    assert node_key({"GROUP_RANK": "3"}, "host-a") == 3
    assert node_key({}, "host-a") == node_key({"GROUP_RANK": ""}, "host-a") != node_key({}, "host-b")


def test_node_key_under_an_agent_is_its_host_and_pid_not_a_stale_group_rank() -> None:
    """Live recovery: two nodes' workers may both still carry the GROUP_RANK they started with; their agents differ."""
    a, b = ({"GROUP_RANK": "0", "ELASTICZERO_AGENT_PID": pid} for pid in ("4194303", "17"))
    assert node_key(a, "host-a") != node_key(b, "host-a")
    assert node_key(a, "host-a") == node_key({**a, "GROUP_RANK": "1"}, "host-a") != node_key(a, "host-b")


def test_grad_message_marks_missing_gradients_and_sends_zeros() -> None:
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    present, ga, gb = grad_message([a, b], torch.device("cpu"))
    assert present.tolist() == [1, 0] and torch.equal(ga, a.grad) and torch.equal(gb, torch.zeros(2))


def test_one_node_replicates_nothing(group: None) -> None:
    opt = ZeroStage2(nn.Linear(3, 2), torch.optim.AdamW, lr=0.1)
    rep = BuddyCopies(opt, step=5)
    assert not rep.plan.enabled and "one node" in rep.plan.reason and rep.copies == {}
    opt.module(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert rep.census() == {0: 6} and rep.nbytes() == 0  # one step past the start, no copies
    assert set(rep.comm_stats.calls) == {("all_gather", "copies")}  # the node gather only: no copies, no gate
    held = rep.holdings()
    assert held.owner == 0 and set(held.states) == {0}
    assert torch.equal(held.states[0].params["weight"].tensor, opt.module.weight.detach().reshape(-1))
    rep.close()


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage2, ZeroStage3])
def test_holdings_before_the_first_step_reshard_into_a_fresh_optimizer(group: None, stage: type) -> None:
    def build() -> ZeroStage2:
        torch.manual_seed(0)
        return stage(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), torch.optim.AdamW, lr=0.1)

    rep = BuddyCopies(build(), step=0)
    resharded, fresh = build(), build()
    assert isinstance(reshard_from(resharded, rep.holdings()), ReshardPlan)  # the held state has no Adam moments yet
    for opt in (resharded, fresh):
        for x in torch.eye(3):
            opt.module(x).sum().backward()
            opt.step()
            opt.zero_grad()
    got, want = resharded.full_state_dict(), fresh.full_state_dict()  # masters and moments
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    rep.close()


def test_early_gradients_count_only_when_every_bucket_was_reduced_once() -> None:
    assert early_grads_usable([1, 1, 1], 2)
    assert not early_grads_usable([1, 2, 1], 0)  # accumulation without no_sync: a shard changed after it was posted
    assert not early_grads_usable([0, 0], 0)  # no backward since the last step: nothing was posted
    assert not early_grads_usable([1], MAX_FACTORS + 1)  # more multiplies than a note carries
    assert early_grads_usable([], 0)  # no bucket at all: nothing to send


def test_replayed_note_gives_the_owners_gradients_bitwise() -> None:
    """The owner unscales (a Python float) and clips (a fp32 tensor) its shards in place; a holder that got them before
    both replays the note on its copy and ends with the same bits (the absent bucket left alone)."""
    g = torch.Generator().manual_seed(0)
    owned = [torch.randn(7, generator=g) * 1e4, torch.randn(5, generator=g)]
    sent = [t.clone() for t in owned]
    before = owned[0].clone()  # the note is not empty: the shards did change after they were sent
    inv_scale = 1.0 / 3000.0  # not a power of two: the Python float's rounding must be the owner's
    clip.unscale_and_check_(owned, inv_scale)
    coef = clip.clip_coef(1.0, torch.linalg.vector_norm(torch.cat(owned)))
    clip.scale_by_(owned, coef)
    factors = [Factor(torch.tensor(inv_scale, dtype=torch.float64), False), Factor(coef, True)]
    absent = torch.full((3,), 9.0)
    master = [nn.Parameter(torch.zeros(n), requires_grad=False) for n in (7, 5, 3)]
    copy = WardCopy(
        0,
        master,
        torch.optim.SGD(master, lr=1.0),
        [*sent, absent],
        torch.tensor([1, 1, 0], dtype=torch.uint8),
        0,
        [],
        torch.zeros(3, dtype=torch.uint8),
    )
    copy.note.copy_(note_of(factors, torch.device("cpu")))
    copy.replay()
    assert all(torch.equal(a, b) for a, b in zip(copy.grads[:2], owned, strict=True))
    assert torch.equal(copy.grads[2], torch.full((3,), 9.0)) and not torch.equal(before, owned[0])


def test_the_copies_keep_nothing_of_the_seed(group: None) -> None:
    """A seed holds the round before's state (the holdings its reshard read): BuddyCopies uses it for its first
    mirror only and keeps no reference to it — else every round's copies would keep the round before alive."""
    opt = ZeroStage2(nn.Linear(3, 2), torch.optim.AdamW, lr=0.1)
    held = {0: opt.sharded_state()}
    probe = weakref.ref(held[0])
    rep = BuddyCopies(opt, nodes=[0], seed=Seed(ReshardPlan(0, {0: 0}, ()), held))
    del held
    gc.collect()
    assert probe() is None
    rep.close()
