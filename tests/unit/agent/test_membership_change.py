"""Membership changes are not failures: the pure decision, the round marks in a real in-process store, and the
torch run-loop facts the agent relies on (canaries)."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
from torch.distributed import HashStore, PrefixStore
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState

from elasticzero.agent.agent import (
    JOB_FAILED_KEY,
    ROUND_CHANGE_KEY,
    ElasticZeroAgent,
    FailureAction,
    RoundView,
    failure_action,
    leaving_is_membership_change,
)

CHANGING = "node 1: restarting its workers for nodes waiting to join"


@pytest.mark.parametrize("remaining", [0, 1, 3])
def test_failure_while_the_round_changes_rejoins_without_spending(remaining: int) -> None:
    assert failure_action(RoundView(changing=CHANGING), remaining) is FailureAction.REJOIN


def test_real_failure_spends_a_restart_or_gives_up() -> None:
    assert failure_action(RoundView(), 2) is FailureAction.RESTART
    assert failure_action(RoundView(), 1) is FailureAction.RESTART
    assert failure_action(RoundView(), 0) is FailureAction.GIVE_UP


def test_a_job_marked_failed_is_not_a_membership_change() -> None:
    view = RoundView(changing=CHANGING, job_failed="node 0: root cause: rank 0 exit code 3")
    assert failure_action(view, 0) is FailureAction.GIVE_UP
    assert failure_action(view, 1) is FailureAction.RESTART


@pytest.mark.parametrize(("world", "min_nodes", "change"), [(3, 2, True), (2, 2, False), (2, 1, True), (1, 1, False)])
def test_leaving_is_a_membership_change_only_if_enough_nodes_remain(world: int, min_nodes: int, change: bool) -> None:
    assert leaving_is_membership_change(world, min_nodes) is change


def _agent(store: object, group_rank: int) -> ElasticZeroAgent:
    agent = ElasticZeroAgent.__new__(ElasticZeroAgent)  # no spec, no workers: only the round marks
    agent._store = store
    agent._worker_group = SimpleNamespace(group_rank=group_rank, group_world_size=2)  # type: ignore[assignment]
    return agent


def test_marks_are_round_scoped_and_read_back() -> None:
    base = HashStore()
    round0, round1 = PrefixStore("torch.rendezvous.job.0", base), PrefixStore("torch.rendezvous.job.1", base)
    restarting, failing = _agent(round0, 1), _agent(round0, 0)
    assert failing._round_view() == RoundView()
    restarting._mark_round_changing("restarting its workers for nodes waiting to join")
    assert failing._round_view() == RoundView(changing=CHANGING)
    assert _agent(round1, 0)._round_view() == RoundView()  # the next round starts unmarked
    round0.set(JOB_FAILED_KEY, "node 1: root cause")
    assert failing._round_view().job_failed == "node 1: root cause"
    assert base.check([f"torch.rendezvous.job.0/{ROUND_CHANGE_KEY}"])


def test_no_store_reads_as_no_mark() -> None:
    agent = _agent(None, 0)
    agent._mark_round_changing("leaving on SIGTERM")  # nothing to mark, no error
    assert agent._round_view() == RoundView()


def test_torch_loop_sets_the_state_before_restarting_and_restarts_healthy_groups_only_for_waiting_nodes() -> None:
    """Canary: ``_restart_workers`` tells a membership restart by the group's state, which torch's loop sets first."""
    src = inspect.getsource(SimpleElasticAgent._invoke_run)
    assert src.index("self._worker_group.state = state") < src.index("self._restart_workers(")
    healthy = src[src.index("state == WorkerState.HEALTHY") :]
    assert re.search(r"num_nodes_waiting\(\).*self\._restart_workers\(", healthy, re.S)
    assert "self._invoke_run(role)" in inspect.getsource(SimpleElasticAgent.run)
    assert WorkerState.HEALTHY.name == "HEALTHY"
