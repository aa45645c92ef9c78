"""A communicator built with a waiter (a live job's bounded wait, elasticzero.live.bounded) routes every wait of its
works through it, synchronous or not (world-size-1 gloo group)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from elasticzero.engine.zero.comm.communicator import Communicator

pytestmark = pytest.mark.timeout(60)


def test_a_communicator_with_a_waiter_waits_through_it(group: None) -> None:
    waited: list[Callable[[], None]] = []

    def waiter(wait: Callable[[], None]) -> None:
        waited.append(wait)
        wait()

    comm = Communicator(waiter=waiter)
    comm.all_reduce(torch.ones(3))
    # an all-reduce: a one-rank group's reduce-scatter and all-gather are local copies (LocalWork), never waited
    work = comm.all_reduce(torch.ones(2), async_op=True)
    assert work is not None and len(waited) == 1
    work.wait()
    work.wait()  # done: not waited again
    assert len(waited) == 2 and work.done
    local = comm.all_gather(torch.empty(2), torch.ones(2), async_op=True)
    assert local is not None and local.done and len(waited) == 2  # done when issued: nothing to wait for
    comm.close()


def test_an_object_all_gather_runs_inside_the_waiter(group: None) -> None:
    """``all_gather_object`` blocks in torch (no work to wait on): with a waiter it runs inside it, so a live round's
    bound leaves it when a member froze before it arrived (the reshard's agreement; tests/integration/live's
    ``JOINSTOP``)."""
    ran: list[str] = []

    def waiter(wait: Callable[[], None]) -> None:
        ran.append("waiter")
        wait()

    assert Communicator(waiter=waiter).all_gather_object({"step": 3}) == [{"step": 3}] and ran == ["waiter"]
    assert Communicator().all_gather_object(7) == [7]  # no waiter: run here
