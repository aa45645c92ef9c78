"""``ElasticZeroAgent``'s exit barrier and failure mark against a real in-process store (no workers started)."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID, RunResult, WorkerState
from torch.distributed.elastic.utils.store import _barrier_nonblocking

from elasticzero.agent.agent import BARRIER_SEEN_KEY, FAILED_SEEN_KEY, JOB_FAILED_KEY, ElasticZeroAgent, PeerFailedError


class FakeHandler:
    """Only what the barrier asks the rendezvous handler."""

    def __init__(self) -> None:
        self.closed = False

    def is_closed(self) -> bool:
        return self.closed


def make_agent(store: HashStore, handler: FakeHandler, world: int = 2, group_rank: int = 0) -> ElasticZeroAgent:
    agent = ElasticZeroAgent.__new__(ElasticZeroAgent)  # no spec, no workers: only the barrier's state
    agent._store = store
    agent._exit_barrier_timeout = 30
    agent._in_exit_barrier = False
    agent._worker_group = SimpleNamespace(  # type: ignore[assignment]
        group_world_size=world, group_rank=group_rank, spec=SimpleNamespace(rdzv_handler=handler)
    )
    return agent


def in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, dict[str, object]]:
    box: dict[str, object] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
            box["result"] = "ok"
        except Exception as exc:
            box["result"] = exc
        box["elapsed"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def test_torch_still_calls_the_overridden_barrier() -> None:
    """``_exit_barrier`` is a protected torch method: fail loudly if a torch upgrade stops calling it."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    assert "self._exit_barrier()" in inspect.getsource(SimpleElasticAgent._invoke_run)
    assert ElasticZeroAgent._exit_barrier is not SimpleElasticAgent._exit_barrier


def test_barrier_completes_when_all_check_in() -> None:
    store, handler = HashStore(), FakeHandler()
    a, b = make_agent(store, handler, group_rank=0), make_agent(store, handler, group_rank=1)
    th, box = in_thread(a._exit_barrier)
    time.sleep(0.5)
    assert th.is_alive()  # still waiting for node 1
    b._exit_barrier()
    th.join(5)
    assert box["result"] == "ok"
    assert store.add(BARRIER_SEEN_KEY, 0) == 2  # both saw the completion before leaving (the store host lingers)


def test_failure_mark_ends_the_wait_and_is_counted() -> None:
    store, handler = HashStore(), FakeHandler()
    waiting, failing = make_agent(store, handler, group_rank=0), make_agent(store, handler, group_rank=1)
    th, box = in_thread(waiting._exit_barrier)
    time.sleep(0.5)
    failing.announce_failure(RunResult(state=WorkerState.FAILED))
    handler.closed = True  # as launch does right after the mark
    th.join(5)
    assert isinstance(box["result"], PeerFailedError)
    assert "node 1: workers failed" in str(box["result"])
    assert float(box["elapsed"]) < 3  # type: ignore[arg-type]
    assert store.get(JOB_FAILED_KEY) == b"node 1: workers failed"
    assert failing.await_peers_informed(timeout=5) < 1  # both counted: the failing node and the one that saw it
    assert store.add(FAILED_SEEN_KEY, 0) == 2


def test_closed_rendezvous_after_success_is_not_a_failure() -> None:
    store, handler = HashStore(), FakeHandler()
    # node 1 already checked in, finished and closed the rendezvous (its launch's shutdown) before node 0 polls
    _barrier_nonblocking(store, 2, _TERMINAL_STATE_SYNC_ID)
    handler.closed = True
    make_agent(store, handler, group_rank=0)._exit_barrier()  # returns: the barrier completed


def test_closed_rendezvous_without_check_in_fails() -> None:
    store, handler = HashStore(), FakeHandler()
    handler.closed = True  # the other node left with a rendezvous error, never reaching the barrier
    with pytest.raises(PeerFailedError, match="closed the rendezvous before finishing"):
        make_agent(store, handler)._exit_barrier()


def test_await_peers_informed_is_bounded() -> None:
    store = HashStore()
    agent = make_agent(store, FakeHandler())
    agent.announce_failure(RunResult(state=WorkerState.FAILED))
    assert 0.9 < agent.await_peers_informed(timeout=1.0) < 3  # nobody else saw it: gives up after the timeout
