"""GradAccumulation: boundaries, loss factor, no_sync selection, state."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

from elasticzero.engine.accumulation import GradAccumulation
from elasticzero.errors import UsageError


def test_boundaries_every_nth_micro_batch() -> None:
    acc = GradAccumulation(3)
    assert [acc.advance() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert [GradAccumulation(1).advance() for _ in range(2)] == [True, True]


def test_scaled_micro_batches_accumulate_the_big_batch_gradient() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(8, 3)
    (x @ w).square().mean().backward()
    assert w.grad is not None
    big = w.grad.clone()
    w.grad = None
    acc = GradAccumulation(4)
    for chunk in x.chunk(4):
        acc.scale_loss((chunk @ w).square().mean()).backward()
        acc.advance()
    torch.testing.assert_close(w.grad, big)


class _WithNoSync:
    def __init__(self) -> None:
        self.entered = 0

    def no_sync(self) -> nullcontext[None]:
        self.entered += 1
        return nullcontext()


def test_no_sync_only_between_boundaries() -> None:
    acc, target = GradAccumulation(2), _WithNoSync()
    for _ in range(4):
        with acc.no_sync(target):
            pass
        acc.advance()
    assert target.entered == 2
    with acc.no_sync(object()):  # no no_sync method: plain context
        pass


class _RefusesNoSync(_WithNoSync):
    supports_no_sync = False  # like ZeroStage3, whose no_sync() raises

    def no_sync(self) -> nullcontext[None]:
        raise UsageError("no no_sync here")


def test_no_sync_falls_back_when_target_does_not_support_it() -> None:
    acc, target = GradAccumulation(2), _RefusesNoSync()
    for _ in range(4):
        with acc.no_sync(target):
            pass
        acc.advance()
    assert target.entered == 0 and acc.micro_step == 4
    # (a real ZeroStage3 goes through this loop in tests/unit/config/test_config_build.py)


def test_no_sync_of_several_targets_enters_each_that_has_one() -> None:
    """``acc.no_sync(model, opt)``: DDP's module or a ZeRO optimizer defers, whichever of the two has ``no_sync``."""
    acc, module, opt = GradAccumulation(3), _WithNoSync(), _WithNoSync()
    for _ in range(6):
        with acc.no_sync(module, object(), opt, _RefusesNoSync()):
            pass
        acc.advance()
    assert (module.entered, opt.entered) == (4, 4)  # micro-batches 1, 2, 4, 5 of 6; never on a boundary


class _Exits(_WithNoSync):
    def __init__(self) -> None:
        super().__init__()
        self.exited = 0

    def no_sync(self) -> Any:
        @contextmanager
        def deferring() -> Any:
            self.entered += 1
            try:
                yield
            finally:
                self.exited += 1

        return deferring()


class _FailsToEnter(_WithNoSync):
    def no_sync(self) -> nullcontext[None]:
        raise RuntimeError("cannot defer")


def test_no_sync_of_several_targets_leaves_none_entered_when_one_fails() -> None:
    acc, first = GradAccumulation(2), _Exits()
    with pytest.raises(RuntimeError, match="cannot defer"):
        acc.no_sync(first, _FailsToEnter())
    assert (first.entered, first.exited) == (1, 1)
    with acc.no_sync(first):
        assert (first.entered, first.exited) == (2, 1)
    assert first.exited == 2


def test_state_round_trip_and_bad_steps() -> None:
    acc = GradAccumulation(4)
    for _ in range(5):
        acc.advance()
    other = GradAccumulation(4)
    other.load_state_dict(acc.state_dict())
    assert other.micro_step == 5 and other.is_boundary is False
    bads: tuple[Any, ...] = (0, -1, 1.5, True)  # deliberately not ints
    for bad in bads:
        with pytest.raises(UsageError, match="accumulation steps"):
            GradAccumulation(bad)
