"""Config tests decide the world size themselves: a torchrun-provided ``WORLD_SIZE`` must not leak in."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_ambient_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
