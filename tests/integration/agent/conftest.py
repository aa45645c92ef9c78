"""Fixtures for the agent integration tests (real elasticzero-run processes on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ez_agentkit import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A job with a unique id; every process it started is killed afterwards."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()
