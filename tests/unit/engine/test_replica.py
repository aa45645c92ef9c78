"""The Replicator's pure pieces (engine/zero/replica.py) and its off path on a one-rank group: one node means no
copies, no exchange, nothing sent, and the holdings are this rank's own live state at the step it is at (the census
counts its own steps: a live job's reshard resumes from it)."""

from __future__ import annotations

import torch
from torch import nn

from elasticzero import ZeroStage2
from elasticzero.engine.zero.replica import Replicator, grad_message, node_key


def test_node_key_prefers_torchelastic_node_rank() -> None:
    assert node_key({"GROUP_RANK": "3"}, "host-a") == 3
    assert node_key({}, "host-a") == node_key({"GROUP_RANK": ""}, "host-a") != node_key({}, "host-b")


def test_under_an_agent_the_node_is_the_agent_not_the_round_it_started_in() -> None:
    """A live job's survivor keeps its start round's GROUP_RANK; a joiner may get the same one later: the agent's
    identity (host, pid) tells their nodes apart, and the workers of one agent share it."""
    survivor = {"GROUP_RANK": "1", "ELASTICZERO_AGENT_PID": "4242"}
    joiner = {"GROUP_RANK": "1", "ELASTICZERO_AGENT_PID": "5353"}
    assert node_key(survivor, "host-a") != node_key(joiner, "host-a")
    assert node_key(survivor, "host-a") == node_key({**survivor, "GROUP_RANK": "0"}, "host-a")
    assert node_key(survivor, "host-a") != node_key(survivor, "host-b")


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
