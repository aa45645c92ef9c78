"""The unit tests of the engine and of the live copies run on an in-process gloo group of world size 1 (no spawned
ranks, loopback only), the `group` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ez_testing import free_port


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A world-size-1 gloo default group for the module's tests, destroyed after them."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
