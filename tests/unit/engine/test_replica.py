"""The Replicator's pure pieces (engine/zero/replica.py) and its off path on a one-rank group: one node means no
copies, no exchange, nothing sent, and the holdings are this rank's own live state at the step it is at (the census
counts its own steps: a live job's reshard resumes from it); holdings taken before the first step reshard into an
optimizer that then trains exactly as a fresh one (a node joined or left before step 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.zero.replica import Replicator, grad_message, node_key
from elasticzero.engine.zero.reshard import ReshardPlan, reshard_from


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
    rep = Replicator(opt, step=5)
    assert not rep.plan.enabled and "one node" in rep.plan.reason and rep.copies == {}
    opt.module(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert rep.census() == {0: 6} and rep.nbytes() == 0  # one step past the start, no copies
    assert set(rep.comm_stats.calls) == {("all_gather", "replica")}  # the node gather only: no copies, no gate
    held = rep.holdings()
    assert held.owner == 0 and set(held.states) == {0}
    assert torch.equal(held.states[0].params["weight"].tensor, opt.module.weight.detach().reshape(-1))
    rep.close()


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage2, ZeroStage3])
def test_holdings_before_the_first_step_reshard_into_a_fresh_optimizer(group: None, stage: type) -> None:
    def build() -> ZeroStage2:
        torch.manual_seed(0)
        return stage(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), torch.optim.AdamW, lr=0.1)

    rep = Replicator(build(), step=0)
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
