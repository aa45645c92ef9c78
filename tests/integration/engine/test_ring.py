"""Ring reduce-scatter / all-gather (engine/zero/ring.py) on real gloo ranks: equal to gloo's own collectives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ez_testing import run_ranks

WORKER = Path(__file__).with_name("ring_worker.py")


def _run(world: int, out: Path) -> list[dict[str, Any]]:
    return run_ranks(WORKER, world, out)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")  # tests/run.sh reruns deselect world3
def test_ring_matches_gloo(world: int, tmp_path: Path) -> None:
    for r, res in enumerate(_run(world, tmp_path / "ring")):
        assert res.pop("used_ring") is True, (r, res)
        assert res.pop("unsettled") == 0, (r, res)
        assert all(res.values()), (r, {k: v for k, v in res.items() if not v})
