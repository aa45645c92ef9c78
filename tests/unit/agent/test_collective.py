"""The workers' collective timeout and torch's NCCL error handling: a pure decision, carried in the plan."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

import pytest

from elasticzero.agent.cli import build_parser
from elasticzero.agent.collective import (
    ASYNC_ERROR_HANDLING,
    ASYNC_ERROR_HANDLING_VALUE,
    BLOCKING_WAIT,
    BLOCKING_WAIT_VALUE,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    HEARTBEAT_TIMEOUT,
    MIN_HEARTBEAT_S,
    collective_plan,
)
from elasticzero.agent.plan import AgentFacts, AgentPlan, plan_agent
from elasticzero.device import COLLECTIVE_TIMEOUT_ENV
from elasticzero.errors import UsageError

FACTS = AgentFacts(pid=7, python="/py", package_root="/site", run_id="rid")


def plan(*flags: str, env: Mapping[str, str] | None = None) -> AgentPlan:
    ns: argparse.Namespace = build_parser().parse_args([*flags, "train.py"])
    return plan_agent(ns, env or {}, FACTS)


def test_default_is_far_below_torchs_and_reaches_every_worker() -> None:
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    torchs = [
        t.total_seconds() for t in (default_pg_timeout, default_pg_nccl_timeout) if t is not None
    ]  # no NCCL: None

    p = plan("--nproc-per-node", "2")
    assert p.collective.timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S
    assert p.collective.source == "default"
    assert DEFAULT_COLLECTIVE_TIMEOUT_S < min(torchs)
    for rank in (0, 1):
        env = p.workers.worker_env(rank)
        assert float(env[COLLECTIVE_TIMEOUT_ENV]) == DEFAULT_COLLECTIVE_TIMEOUT_S
        assert env[ASYNC_ERROR_HANDLING] == ASYNC_ERROR_HANDLING_VALUE
        assert env[BLOCKING_WAIT] == BLOCKING_WAIT_VALUE


def test_the_flag_sets_the_timeout_and_the_heartbeat_backstop() -> None:
    p = plan("--collective-timeout", "12.5")
    assert (p.collective.timeout_s, p.collective.source) == (12.5, "--collective-timeout")
    assert p.workers.env[COLLECTIVE_TIMEOUT_ENV] == "12.5"
    assert p.workers.env[HEARTBEAT_TIMEOUT] == str(MIN_HEARTBEAT_S)  # never below the floor
    assert plan("--collective-timeout", "900").workers.env[HEARTBEAT_TIMEOUT] == "900"


def test_users_environment_value_is_used_and_the_flag_wins_over_it() -> None:
    from_env = plan(env={COLLECTIVE_TIMEOUT_ENV: "45"})
    assert (from_env.collective.timeout_s, from_env.collective.source) == (45.0, COLLECTIVE_TIMEOUT_ENV)
    assert from_env.workers.env[COLLECTIVE_TIMEOUT_ENV] == "45"
    both = plan("--collective-timeout", "8", env={COLLECTIVE_TIMEOUT_ENV: "45"})
    assert both.workers.env[COLLECTIVE_TIMEOUT_ENV] == "8"


@pytest.mark.parametrize(
    "user",
    [
        {ASYNC_ERROR_HANDLING: "1"},
        {"NCCL_ASYNC_ERROR_HANDLING": "0"},  # torch's older spelling counts as the user's choice
        {BLOCKING_WAIT: "1"},
        {"NCCL_BLOCKING_WAIT": "1"},
        {HEARTBEAT_TIMEOUT: "1000"},
    ],
)
def test_nccl_knobs_the_user_set_are_left_alone(user: dict[str, str]) -> None:
    env = collective_plan(None, user).env
    for name in user:
        assert name not in env  # the worker inherits the user's own value from the agent's environment
    canonical = {ASYNC_ERROR_HANDLING, BLOCKING_WAIT, HEARTBEAT_TIMEOUT}
    untouched = canonical - {n for n in canonical if n in user or f"NCCL_{n.split('TORCH_NCCL_')[1]}" in user}
    assert untouched <= set(env)


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf", "soon", ""])
def test_bad_timeout_is_one_usage_line_naming_the_source(bad: str) -> None:
    with pytest.raises(UsageError, match=r"--collective-timeout.*positive number of seconds"):
        plan("--collective-timeout", bad)
    with pytest.raises(UsageError, match=rf"{COLLECTIVE_TIMEOUT_ENV}=.*positive number of seconds"):
        plan(env={COLLECTIVE_TIMEOUT_ENV: bad})


def test_dry_run_json_shows_the_decision() -> None:
    p = plan("--collective-timeout", "20", env={BLOCKING_WAIT: "1"})
    shown = json.loads(p.to_text())
    assert shown["collective"]["timeout_s"] == 20.0
    assert shown["collective"]["source"] == "--collective-timeout"
    assert shown["collective"]["env"] == dict(p.collective.env)
    assert BLOCKING_WAIT not in shown["collective"]["env"]
    assert shown["workers"]["env"]["0"][COLLECTIVE_TIMEOUT_ENV] == "20"
