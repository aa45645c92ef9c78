"""Membership changes are not failures (the decision over a failure: tests/unit/agent/test_tick.py): the rule for a
node leaving, the round marks in a real in-process store, and the torch run-loop facts the agent relies on
(canaries)."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
from torch.distributed import HashStore, PrefixStore
from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerGroup, WorkerState

from elasticzero.agent.agent import FAILED_SEEN_KEY, JOB_FAILED_KEY, ROUND_CHANGE_KEY, ElasticZeroAgent, PeerFailedError
from elasticzero.agent.hang import HangWatch
from elasticzero.agent.progress import NO_HANG
from elasticzero.agent.tick import Continue, Facts, Halt, RoundView, Stop, Workers, decide, leaving_is_membership_change

CHANGING = "node 1: restarting its workers for nodes waiting to join"
CLOSED_LINE = "the rendezvous was closed by another node; stopping this node's workers"


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


def _ticking_agent(store: object) -> ElasticZeroAgent:
    """An agent whose tick reads a real store and a rendezvous handler's closed flag (no peer watch, no hang watch)."""
    agent = _agent(store, 0)
    agent._peers, agent._rounds, agent._remaining_restarts, agent._hang = None, None, 1, HangWatch(NO_HANG)
    return agent


def _group(closed: bool) -> WorkerGroup:
    handler = SimpleNamespace(is_closed=lambda: closed)
    return SimpleNamespace(workers=[], spec=SimpleNamespace(rdzv_handler=handler))  # type: ignore[return-value]


def test_a_healthy_tick_gathers_the_marks_and_a_job_marked_failed_stops_the_node() -> None:
    store = PrefixStore("torch.rendezvous.job.0", HashStore())
    agent, healthy = _ticking_agent(store), RunResult(state=WorkerState.HEALTHY)
    assert agent._tick_facts(_group(False), healthy) == Facts(Workers.HEALTHY, False, 1)
    assert decide(agent._tick_facts(_group(True), healthy)) == Stop(Halt.CLOSED, CLOSED_LINE)
    store.set(JOB_FAILED_KEY, "node 1: root cause")
    facts = agent._tick_facts(_group(False), healthy)
    assert facts.marks == RoundView(job_failed="node 1: root cause")
    with pytest.raises(PeerFailedError, match="whose workers failed: node 1: root cause"):
        agent._carry_out(decide(facts), _group(False), healthy)
    assert store.add(FAILED_SEEN_KEY, 0) == 1  # it counted itself as informed before it stopped
    assert agent._carry_out(Continue(), _group(False), healthy) is healthy


def test_torch_loop_sets_the_state_before_restarting_and_restarts_healthy_groups_only_for_waiting_nodes() -> None:
    """Canary: ``_restart_workers`` tells a membership restart by the group's state, which torch's loop sets first."""
    src = inspect.getsource(SimpleElasticAgent._invoke_run)
    assert src.index("self._worker_group.state = state") < src.index("self._restart_workers(")
    healthy = src[src.index("state == WorkerState.HEALTHY") :]
    assert re.search(r"num_nodes_waiting\(\).*self\._restart_workers\(", healthy, re.S)
    assert "self._invoke_run(role)" in inspect.getsource(SimpleElasticAgent.run)
    assert WorkerState.HEALTHY.name == "HEALTHY"
