"""ZeroOptions: the one place a stage constructor's keyword arguments are told apart (options vs the wrapped
optimizer's), and the type saying which stage takes which option (config/build.py asks it)."""

from __future__ import annotations

import dataclasses

import pytest

from elasticzero.engine.zero.options import ZeroOptions
from elasticzero.errors import UsageError


def test_split_separates_options_from_optimizer_kwargs() -> None:
    options, rest = ZeroOptions.split({"lr": 1e-3, "bucket_bytes": 4096, "precision": "bf16"}, stage=2)
    assert rest == {"lr": 1e-3}
    assert (options.bucket_bytes, options.precision) == (4096, "bf16")
    assert options.max_inflight == ZeroOptions().max_inflight  # untouched fields keep their defaults


def test_keyword_arguments_override_a_given_options_object() -> None:
    base = ZeroOptions(bucket_bytes=1024, prefetch=False)
    options, rest = ZeroOptions.split({"bucket_bytes": 2048, "betas": (0.9, 0.95)}, stage=3, base=base)
    assert (options.bucket_bytes, options.prefetch, rest) == (2048, False, {"betas": (0.9, 0.95)})
    assert base.bucket_bytes == 1024  # frozen: the given object is not changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.bucket_bytes = 1  # type: ignore[misc]


def test_stage3_options_are_refused_by_stages_1_and_2() -> None:
    stage3_only = {"units", "reshard_after_forward", "prefetch", "prefetch_bytes"}
    assert ZeroOptions.taken_by(3) == ZeroOptions.names()
    for stage in (1, 2):
        assert ZeroOptions.taken_by(stage) == ZeroOptions.names() - stage3_only
        with pytest.raises(UsageError, match=f"ZeroStage{stage} does not take prefetch"):
            ZeroOptions.split({"prefetch": False, "lr": 0.1}, stage=stage)
