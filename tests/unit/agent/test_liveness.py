"""Peer liveness as a pure decision: the peer timeout and its heartbeat, and the verdict over one snapshot; and the
plan's ``--peer-timeout`` (through ``elasticzero-run``'s parser, as ``--dry-run`` prints it)."""

from __future__ import annotations

import pytest

from elasticzero.agent.liveness import (
    DEFAULT_PEER_TIMEOUT_S,
    MIN_BEATS,
    TORCH_KEEP_ALIVE,
    Liveness,
    Snapshot,
    judge,
    keep_alive_for,
    node_host,
    peer_plan,
    store_lost_line,
)
from elasticzero.agent.options import RDZV_DEFAULTS
from elasticzero.errors import UsageError

A, B, C = "10.0.0.1_100_0", "10.0.0.2_200_0", "10.0.0.3_300_0"
T = 4.0


def snap(beats: dict[str, float], now: float = 100.0, wait: float = 0.0, me: str = A) -> Snapshot:
    return Snapshot(me, frozenset({A, B, C}), beats, now, wait)


# -- the timeout and its heartbeat ------------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [3, 4, 5, 7, 8, 10, 12, 15, 30, 60, 97])
def test_the_keep_alive_age_is_exactly_the_timeout_with_at_least_min_beats(timeout: int) -> None:
    interval, attempts = keep_alive_for(timeout)
    assert interval * attempts == timeout  # torch drops a node at exactly the peer timeout
    assert attempts >= MIN_BEATS  # a live node's heartbeat may be two beats old


def test_the_default_is_elasticzero_run_s_rendezvous_default() -> None:
    plan = peer_plan(None, {}, torch_defaults=False)
    assert (plan.timeout_s, plan.source) == (DEFAULT_PEER_TIMEOUT_S, "default")
    assert {k: RDZV_DEFAULTS[k] for k in plan.rdzv_conf()} == plan.rdzv_conf()


def test_torch_defaults_and_the_users_keep_alive_give_the_timeout() -> None:
    torch_plan = peer_plan(None, {}, torch_defaults=True)
    assert torch_plan.timeout_s == TORCH_KEEP_ALIVE[0] * TORCH_KEEP_ALIVE[1]
    user = peer_plan(None, {"keep_alive_interval": "2", "keep_alive_max_attempt": "5"}, torch_defaults=False)
    assert (user.timeout_s, user.source) == (10, "--rdzv-conf")


def test_the_flag_sets_the_heartbeat_and_must_agree_with_the_users() -> None:
    plan = peer_plan("10", {}, torch_defaults=True)
    assert (plan.timeout_s, plan.rdzv_conf()) == (10, {"keep_alive_interval": "2", "keep_alive_max_attempt": "5"})
    assert peer_plan("10", {"keep_alive_interval": "2"}, torch_defaults=False).timeout_s == 10
    with pytest.raises(UsageError, match=r"--peer-timeout 10 contradicts --rdzv-conf keep_alive_interval=1"):
        peer_plan("10", {"keep_alive_interval": "1"}, torch_defaults=False)


@pytest.mark.parametrize(("flag", "why"), [("2", "must be >= 3"), ("2.5", "whole seconds"), ("x", "whole seconds")])
def test_bad_timeouts_are_one_line(flag: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        peer_plan(flag, {}, torch_defaults=False)


# -- the verdict ------------------------------------------------------------------------------------------------------


def test_everyone_heard_within_the_timeout_is_alive() -> None:
    assert judge(snap({A: 99.0, B: 96.0, C: 100.0}), T, True) == Liveness()
    assert judge(snap({A: 99.0, B: 96.0, C: 100.0}), T, True).alive


def test_a_peer_silent_past_the_timeout_or_dropped_is_gone() -> None:
    verdict = judge(snap({A: 99.0, B: 95.9}), T, False)  # B silent 4.1 s, C dropped by another node's read
    assert verdict.gone == (B, C) and not verdict.self_gone and not verdict.alive


def test_this_node_silent_means_it_was_frozen_and_must_rejoin() -> None:
    assert judge(snap({A: 90.0, B: 99.0, C: 99.0}), T, True) == Liveness(self_gone=True)
    assert judge(snap({B: 99.0, C: 99.0}), T, True) == Liveness(self_gone=True)


def test_a_silent_store_counts_only_where_a_peer_hosts_it() -> None:
    beats = {A: 99.0, B: 99.0, C: 99.0}
    assert judge(snap(beats, wait=4.5), T, store_is_a_peer=True) == Liveness(store_silent_s=4.5)
    assert judge(snap(beats, wait=4.5), T, store_is_a_peer=False).alive  # etcd: its client has its own bound
    assert judge(snap(beats, wait=3.9), T, store_is_a_peer=True).alive


def test_the_store_line_names_the_host_the_cause_and_the_fix() -> None:
    line = store_lost_line(peer_plan(None, {}, False, store_in_agent="node1:29400"), 4.3)
    assert "node1:29400" in line and "4.3 s" in line and "cannot survive its store host" in line and "etcd" in line
    assert "\n" not in line
    assert node_host(B) == "10.0.0.2"


# -- the plan: elasticzero-run's flag, shown by --dry-run, and the launcher passing it ---------------------------------


def _plan(*argv: str):
    from elasticzero.agent.cli import build_parser
    from elasticzero.agent.plan import AgentFacts, plan_agent

    facts = AgentFacts(pid=1, python="/py", package_root="/site", run_id="fresh")
    return plan_agent(build_parser().parse_args([*argv, "train.py"]), {}, facts)


def test_the_flag_reaches_the_rendezvous_config_and_the_dry_run() -> None:
    plan = _plan("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "hostA:29400", "--peer-timeout", "8")
    assert (plan.rdzv.config["keep_alive_interval"], plan.rdzv.config["keep_alive_max_attempt"]) == ("2", "4")
    shown = plan.to_json()["peers"]
    assert (shown["timeout_s"], shown["source"], shown["store_in_agent"]) == (8, "--peer-timeout", "hostA:29400")


def test_etcd_has_no_store_in_an_agent_and_static_takes_no_peer_timeout() -> None:
    plan = _plan("--nnodes", "1:2", "--rdzv-backend", "elasticzero", "--rdzv-endpoint", "etcd://e:2379")
    assert plan.peers is not None and plan.peers.store_in_agent is None and plan.peers.timeout_s == 4
    with pytest.raises(UsageError, match="--peer-timeout needs a dynamic rendezvous"):
        _plan("--rdzv-backend", "static", "--master-addr", "h", "--master-port", "1", "--peer-timeout", "5")


def test_the_launcher_passes_the_flag_to_every_agent() -> None:
    from elasticzero.launch.plan import AgentOptions, LaunchPlan, NodeSpec

    nodes = (NodeSpec("h0", 0, (0,)), NodeSpec("h1", 1, (0,)))
    plan = LaunchPlan("job", "pdsh", nodes, "h0", 29400, ("train.py",), "/", AgentOptions("2", peer_timeout=6))
    argv = plan.agent_argv(["--node-rank", "0"])
    assert argv[argv.index("--peer-timeout") + 1] == "6"
