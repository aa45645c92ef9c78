"""LossScaler's overflow agreement builds one communicator per group and reuses it (not one per agreement)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from elasticzero.engine import loss_scaler
from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.engine.zero import comm
from elasticzero.errors import UsageError


class _OwnGradsOptimizer:
    """The ZeRO stages' side of the protocol: unscales itself, reports a clean local flag, names its group."""

    def __init__(self, process_group: Any) -> None:
        self.process_group, self.param_groups, self.steps = process_group, [], 0

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        return torch.tensor(0.0)

    def step(self) -> None:
        self.steps += 1


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[comm.Communicator]:
    """Every communicator the scaler builds from now on (real ones, recorded as they are built)."""
    made: list[comm.Communicator] = []

    class Recorded(comm.Communicator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(loss_scaler.comm, "Communicator", Recorded)
    return made


def _steps(scaler: LossScaler, opt: Any, n: int) -> None:
    for _ in range(n):
        scaler.step(opt)
        scaler.update()


def test_one_communicator_per_group_reused_across_steps(group: None, built: list[comm.Communicator]) -> None:
    explicit = dist.new_group([0], backend="gloo")
    own, plain = _OwnGradsOptimizer(explicit), torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scaler = LossScaler(8.0)
    _steps(scaler, own, 3)
    assert [c.group for c in built] == [explicit]  # the optimizer's group: built at the first agreement, then reused
    plain.param_groups[0]["params"][0].grad = torch.zeros(2)
    _steps(scaler, plain, 3)
    assert [c.group for c in built] == [explicit, dist.group.WORLD]  # the default group's: one more, reused
    _steps(scaler, own, 2)
    assert len(built) == 2 and own.steps == 5


def test_a_new_group_gets_its_own_communicator(group: None, built: list[comm.Communicator]) -> None:
    first = dist.new_group([0], backend="gloo")
    own, scaler = _OwnGradsOptimizer(first), LossScaler(8.0)
    _steps(scaler, own, 2)
    dist.destroy_process_group(first)
    own.process_group = second = dist.new_group([0], backend="gloo")  # its communicator was replaced
    _steps(scaler, own, 2)
    assert [c.group for c in built] == [first, second]


def test_a_group_this_process_is_not_in_is_a_usage_error(group: None) -> None:
    own = _OwnGradsOptimizer(dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(UsageError, match="not in the group"):
        LossScaler(8.0).step(own)
