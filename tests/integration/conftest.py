"""Fixtures shared by the integration tests that run real ``elasticzero-run`` agents (``agent/``, ``elastic/``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("agent")))  # the agent tests' kit: start, watch, reap agents
from ez_agentkit import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A job with a unique id; every process it started (stopped ones included) is killed afterwards."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()
