"""agent/rejoin.py: how long a node cut off from its rendezvous tries to join again, and what it says."""

from __future__ import annotations

import pytest

from elasticzero.agent.rejoin import (
    DEFAULT_REJOIN,
    PAUSE_S,
    TORCH_JOIN_TIMEOUT_S,
    GiveUp,
    RejoinPlan,
    Retry,
    cut_off_line,
    next_try,
    rejoin_plan,
)
from elasticzero.errors import UsageError


def test_the_budget_is_the_flag_else_the_join_timeout() -> None:
    assert rejoin_plan("90", {"join_timeout": "60"}) == RejoinPlan(90, "--rejoin-timeout")
    assert rejoin_plan(None, {"join_timeout": "60", "timeout": "900"}) == RejoinPlan(60, "join_timeout")
    assert rejoin_plan(None, {"timeout": "900"}) == RejoinPlan(900, "timeout")
    assert rejoin_plan(None, {}) == DEFAULT_REJOIN == RejoinPlan(TORCH_JOIN_TIMEOUT_S, "default: the join timeout")
    assert rejoin_plan("0", {}).timeout_s == 0


@pytest.mark.parametrize(
    ("flag", "message"),
    [("1.5", "--rejoin-timeout '1.5': not a whole number of seconds"), ("-1", "--rejoin-timeout -1: must be >= 0")],
)
def test_bad_budgets(flag: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        rejoin_plan(flag, {})
    with pytest.raises(UsageError, match="--rdzv-conf join_timeout 'x': not a whole number of seconds"):
        rejoin_plan(None, {"join_timeout": "x"})


def test_tries_until_the_budget_is_spent() -> None:
    plan = RejoinPlan(30, "join_timeout")
    assert next_try(plan, 0.0, "e") == Retry(PAUSE_S)
    assert next_try(plan, 29.5, "e") == Retry(0.5)
    gave_up = next_try(plan, 30.0, "RendezvousConnectionError: no store")
    assert isinstance(gave_up, GiveUp)
    assert gave_up.line == (
        "could not join the rendezvous again within 30 s of being cut off (join_timeout; --rejoin-timeout): "
        "RendezvousConnectionError: no store; exiting"
    )


def test_one_line_says_what_and_for_how_long() -> None:
    line = cut_off_line("the store has not answered", RejoinPlan(600, "default: the join timeout"))
    assert line == (
        "the store has not answered; this node stopped its workers and tries to join the rendezvous again as a new "
        "node for up to 600 s (default: the join timeout; --rejoin-timeout)"
    )
    assert cut_off_line("x", RejoinPlan(0, "--rejoin-timeout")).endswith("exits (--rejoin-timeout 0)")


def test_the_agent_plan_and_the_launcher_carry_it() -> None:
    from elasticzero.agent.cli import build_parser
    from elasticzero.agent.plan import AgentFacts, plan_agent
    from elasticzero.launch.plan import AgentOptions, LaunchPlan, NodeSpec

    facts = AgentFacts(pid=1, python="/py", package_root="/site", run_id="fresh")
    argv = ["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "join_timeout=45", "train.py"]
    plan = plan_agent(build_parser().parse_args(argv), {}, facts)
    assert plan.to_json()["rejoin"] == {"timeout_s": 45, "source": "join_timeout"}
    plan = plan_agent(build_parser().parse_args(["--rejoin-timeout", "7", *argv]), {}, facts)
    assert plan.rejoin == RejoinPlan(7, "--rejoin-timeout")
    nodes = (NodeSpec("h0", 0, (0,)),)
    launch = LaunchPlan("job", "pdsh", nodes, "h0", 1, ("train.py",), "/", AgentOptions("1", rejoin_timeout=7))
    agent_argv = launch.agent_argv(["--node-rank", "0"])
    assert agent_argv[agent_argv.index("--rejoin-timeout") + 1] == "7"
