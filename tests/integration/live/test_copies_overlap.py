"""Buddy copies whose gradients go to the holder during backward (live/copies.py, ``BuddyCopies(early=True)``)
with real gloo ranks: one driver process forks a world of 2 per case (``copies_overlap_worker.py``): ZeRO-1/2/3 in
fp32, bf16 and fp16, through the engine's step path with a loss scaler (one step skipped for an inf) and a clip that
bites, with one backward per step and with accumulation (``no_sync``: still sent early; repeated backward: sent at the
pre-step hook), and under ZeRO-Offload's host path once per stage (stage 3 with the parameters offloaded too).
After the steps every holder's copy equals its ward's live state bitwise."""

from __future__ import annotations

import json
from pathlib import Path

from copies_overlap_worker import CASES

from ez_testing import run_driver

HERE = Path(__file__).parent


def test_copies_stay_bitwise_with_gradients_sent_during_backward(tmp_path: Path) -> None:
    out = tmp_path / "overlap"
    run_driver(HERE / "copies_overlap_worker.py", out)
    for case in CASES:
        name = "_".join(map(str, case))
        for r in range(2):
            problems = json.loads(Path(f"{out}.{name}.rank{r}").read_text())
            assert problems == [], f"{name} rank {r}: {problems}"
