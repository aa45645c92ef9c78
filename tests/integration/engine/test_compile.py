"""torch.compile (Inductor) with ZeroStage1/2/3 on real gloo ranks (1 and 2): per-block (``block.compile()`` on each
transformer block, torchtitan's pattern) and whole-model (``torch.compile(model)``), fp32 and bf16.

One launch per world size runs every scenario of ``compile_worker.SCENARIOS`` (a covering subset: each stage in both
modes and both precisions; why not all 12, see there). Asserted per scenario:

- compiled training equals eager training: ``ratio`` = ``ez_numerics.error_ratio(compiled, eager, fp64 truth)`` <= 1,
  i.e. the compiled run is no further from plain AdamW in float64 than 3x what rounding moved the eager run of the
  same stage and precision (torch's ``fp64_ref`` rule). Inductor fuses and keeps intermediates in fp32 (bf16 too), so
  it rounds differently from eager, not more: a real fault (a hook traced with stale state, a freed parameter read, a
  wrong gradient shard) is off by learning-rate-sized amounts, far beyond that bound.
- no recompilation after warm-up: the steps after ``WARMUP`` run under
  ``torch.compiler.set_stance("fail_on_recompile")`` (a recompile raises, naming the guard that failed) and Dynamo
  compiled 0 frames during them; the warm-up compiled at least one (the run did compile).

Cost: Inductor's first compile in a fresh cache (its C++ toolchain checks, then g++ per graph) dominates; world 1 runs
first and world 2 reuses the compiled kernels from Inductor's on-disk cache (the per-rank batch is the same, so the
graphs are). ``compile_s`` per scenario is printed (``pytest -s``). Inductor needs a C++ compiler (g++; installed by
tests/cluster/packages.sh).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import compile_worker
import pytest

from ez_testing import require, run_ranks

WORKER = Path(compile_worker.__file__)
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]
SCENARIOS = [f"s{s}_{m}_{p}" for s, m, p in compile_worker.SCENARIOS]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    require(shutil.which(os.environ.get("CXX", "g++")) is not None, "Inductor needs a C++ compiler (g++)")
    out = tmp_path_factory.mktemp(f"compile{request.param}") / "result.json"
    reports = run_ranks(WORKER, request.param, out, timeout=570)
    for r in reports:
        assert "error" not in r, r["error"]
    for name in SCENARIOS:
        print(f"world {request.param} {name}: " + ", ".join(f"{k}={v}" for k, v in reports[0][name].items()))
    return reports


@pytest.mark.parametrize("name", SCENARIOS)
def test_compiled_training_equals_eager(ranks: list[dict[str, Any]], name: str) -> None:
    for report in ranks:
        assert report[name]["ratio"] <= 1.0, report[name]


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_recompilation_after_warmup(ranks: list[dict[str, Any]], name: str) -> None:
    for report in ranks:
        assert report[name]["warmup_frames"] >= 1, report[name]  # it compiled
        assert "recompile_error" not in report[name], report[name]["recompile_error"]
        assert report[name]["after_frames"] == 0, report[name]
