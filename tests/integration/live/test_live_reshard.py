"""In-memory reshard from buddy copies (live/copies.py, live/reshard.py) with real gloo ranks: one
driver process forks a world of 3 per case (``live_reshard_worker.py``): a rank SIGKILLed at ZeRO-1/2/3 in fp32 and
bf16 (the survivors reshard 3 -> 2 in the same processes, over a new group), a rank joining (2 -> 3, stage 2 -> 3;
one survivor's masters detached, as an in-place rewrap holds them), two ranks lost at once (a fallback, nothing
touched), a rank joining one alone (1 -> 2: the new copies made from the reshard where a rank sent its ward the whole
state). After the reshard the fp32 masters, Adam moments and step counters equal the step-K state bitwise (what a
DCP reshard restores); two more steps at the new world end where plain torch from that state ends, within
``ez_numerics``' rounding rule (error against the float64 truth at most 3x plain torch's in the same precision)."""

from __future__ import annotations

import json
from pathlib import Path

from live_reshard_worker import CASES

from ez_testing import run_driver

HERE = Path(__file__).parent


def test_live_reshard_matrix(tmp_path: Path) -> None:
    out = tmp_path / "live"
    run_driver(HERE / "live_reshard_worker.py", out)
    for case in CASES:
        name = "_".join(map(str, case))
        alive = {"drop": [0, 1], "lose2": [0], "join": [0, 1, 2], "grow": [0, 1]}[case[2]]
        for r in alive:
            problems = json.loads(Path(f"{out}.{name}.rank{r}").read_text())
            assert problems == [], f"{name} rank {r}: {problems}"
