"""GradBucketer in one process (a world-size-1 gloo group): order, accumulation, no_sync, leftovers.

The multi-rank behaviour (all-reduce mean equal to the global-batch gradient on 2 and 3 ranks) is asserted in
``test_zero_equality.py::test_bucketer_all_reduce_matches_global_batch``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero import GradBucketer
from elasticzero.errors import UsageError

pytestmark = pytest.mark.timeout(60)


def _two_params() -> tuple[nn.Parameter, nn.Parameter]:
    return nn.Parameter(torch.full((3,), 2.0)), nn.Parameter(torch.full((40,), 3.0))


def test_flush_order_is_registration_order_not_hook_order(group: None) -> None:
    p0, p1 = _two_params()  # p0 registered first...
    b = GradBucketer([("p0", p0), ("p1", p1)], bucket_bytes=64)
    x = torch.ones(40)
    loss = ((x * p1).sum() * p0).sum()  # ...and its gradient is ready first; p1's only after
    loss.backward()
    assert [bk.names for bk in b.buckets] == [("p0",), ("p1",)]
    assert b.last_launch_order == [1, 0]  # reverse registration, whatever the hook order was
    torch.testing.assert_close(p0.grad, torch.full((3,), 40 * 3.0))
    torch.testing.assert_close(p1.grad, torch.full((40,), 3 * 2.0))


def test_repeated_backward_accumulates_and_no_sync_defers(group: None) -> None:
    p0, p1 = _two_params()
    b = GradBucketer([p0, p1], bucket_bytes=1 << 20)
    with b.no_sync():
        (p0.sum() + p1.sum()).backward()
    assert b.comm_stats.calls[("all_reduce", "grad")] == 0
    assert p0.grad is None and len(b.held_buffers()) == 1  # held in the bucket buffer until the boundary
    (p0.sum() + p1.sum()).backward()
    (2 * p0.sum() + 2 * p1.sum()).backward()
    assert b.comm_stats.calls[("all_reduce", "grad")] == 2
    torch.testing.assert_close(p0.grad, torch.full((3,), 4.0))
    torch.testing.assert_close(p1.grad, torch.full((40,), 4.0))


def test_params_without_grad_keep_their_gradient(group: None) -> None:
    p0, p1 = _two_params()
    b = GradBucketer([p0, p1], bucket_bytes=1 << 20)
    (p0.sum() + p1.sum()).backward()
    p0.sum().backward()  # p1 unused in this backward: its accumulated grad must survive the reduction
    torch.testing.assert_close(p0.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(p1.grad, torch.full((40,), 1.0))
    assert b.last_launch_order == [0]


def test_frozen_params_skipped_and_bad_op_rejected(group: None) -> None:
    p0, p1 = _two_params()
    p1.requires_grad_(False)
    b = GradBucketer([p0, p1])
    assert [bk.params for bk in b.buckets] == [[p0]]
    with pytest.raises(UsageError, match="all_reduce"):
        GradBucketer([p0], op="broadcast")  # type: ignore[arg-type]
    b.remove()
