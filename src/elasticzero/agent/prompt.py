"""A live job's re-formations, prompt: torch's rendezvous ops unchanged, without their fixed waits.

torch's op executor (``_DistributedRendezvousOpExecutor.run`` in ``dynamic_rendezvous.py``) sleeps one second each
time an op answers SYNC (wait for the others), reads the state through its holder's one-second cache, and a round
with at least ``min_nodes`` but fewer than ``max_nodes`` participants waits out the last call for stragglers. After a
live job lost a node (its heartbeat expired, or the ask dropped it), every survivor leaves the old round and joins the
next at once — and then waits ~1 s for the last call plus up to 1 s for its next poll: most of a crash's cost in
bench/README.md run 6. Under ``--live-recovery`` :func:`make_prompt` gives torch's handler this executor:

1. *poll*: an op's SYNC waits ``poll_s`` (the period the agent's peer watch reads the state at already: every monitor
   tick with c10d, :data:`~elasticzero.agent.peers.READ_PERIOD_S` with etcd), not 1 s, and the holder's cache is
   that long too;
2. *complete when everyone expected is in*: the agent hands its executor the nodes it expects in the next round
   (:func:`expect`: the round's nodes it last read alive, less those it drops) before a hand-off's re-formation; a
   participant that would wait out the last call marks the round complete (:func:`complete_now`, pure) as soon as
   those are all participants and nobody else is known to the state — no other node heartbeats there (torch's own
   sanitizer has dropped the dead ones), nobody is on the wait or redundancy list. The last call waits for nodes
   coming; the agent and the state say none is. A node in neither (an agent still starting) joins the next round: a
   hand-off that costs the running workers a reshard. Any other rendezvous — the job's first round, a restart — has
   no expectation and keeps torch's last call. The expectation is the agent's, not the state's, because a node that
   leaves the old round drops its heartbeat from the state until it joins the new one (torch's exit op): for that
   moment the state alone would show one node fewer.

Everything else — which op runs, its deadlines, each action and the compare-and-set of the state — is torch's: the
executor hands torch's loop the same actions torch's ops return, only sooner. The private names used here have
canaries (``tests/unit/test_torch_canaries.py``) and rows in docs/architecture.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _Action,
    _DistributedRendezvousOpExecutor,
    _RendezvousContext,
    _RendezvousJoinOp,
)

StateHandler = Callable[[_RendezvousContext, float], _Action]


def complete_now(state: Any, node: Any, min_nodes: int, max_nodes: int, expected: frozenset[str] | None) -> bool:
    """Whether ``node``, told by torch's join op to wait (SYNC), may mark the round of ``state`` (a torch
    ``_RendezvousState``) complete now instead of at the last call's deadline: the round still open, ``node`` a
    participant, the participants a valid world, the last call running (torch's deadline set), every ``expected``
    node (by ``repr``, as the agent names nodes) a participant and every node the state knows of too (see the
    module). ``expected`` None: no expectation, torch's last call."""
    members = set(state.participants)
    return (
        expected is not None
        and expected <= {repr(n) for n in members}
        and not state.complete
        and not state.closed
        and node in members
        and min_nodes <= len(members) <= max_nodes
        and state.deadline is not None
        and set(state.last_heartbeats) <= members
        and not state.wait_list
        and not state.redundancy_list
    )


class PromptExecutor(_DistributedRendezvousOpExecutor):
    """torch's executor; each op's SYNC is waited here, ``poll_s`` at a time, until the op answers something else
    (or :func:`complete_now` says the join may complete) — torch's loop then carries that action out as its own.
    ``expected``: the nodes the next join expects (:func:`expect`), used by that join only."""

    def __init__(self, node: Any, state_holder: Any, settings: Any, poll_s: float) -> None:
        super().__init__(node, state_holder, settings)
        self.poll_s = poll_s
        self.expected: frozenset[str] | None = None

    def run(
        self,
        state_handler: StateHandler,
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        try:
            super().run(functools.partial(self._until_due, state_handler), deadline, update_deadline)
        finally:
            if isinstance(state_handler, _RendezvousJoinOp):
                self.expected = None  # one join's: a later rendezvous (a restart) waits out torch's last call

    def _until_due(self, state_handler: StateHandler, ctx: _RendezvousContext, deadline: float) -> _Action:
        """``state_handler``'s first action other than SYNC, re-reading the state every ``poll_s`` meanwhile (as
        torch's loop re-reads it before each call: the state the action applies to is the one it was decided on)."""
        joining = isinstance(state_handler, _RendezvousJoinOp)
        while True:
            action = state_handler(ctx, deadline)
            if action is not _Action.SYNC:
                return action
            lo, hi = ctx.settings.min_nodes, ctx.settings.max_nodes
            if joining and complete_now(ctx.state, ctx.node, lo, hi, self.expected):
                return _Action.MARK_RENDEZVOUS_COMPLETE
            time.sleep(self.poll_s)
            self._state_holder.sync()
            self._state = self._state_holder.state
            ctx = _RendezvousContext(self._node, self._state, self._settings)


def make_prompt(handler: Any, poll_s: float) -> bool:
    """Give ``handler`` (torch's ``DynamicRendezvousHandler``, elasticzero's included) the :class:`PromptExecutor`
    and a state cache of ``poll_s``; whether it took them (any other handler is left as it is)."""
    if not isinstance(handler, DynamicRendezvousHandler):
        return False
    holder = handler._state_holder
    if not hasattr(holder, "_cache_duration"):
        return False
    holder._cache_duration = poll_s
    handler._op_executor = PromptExecutor(handler._this_node, holder, handler._settings, poll_s)
    return True


def expect(handler: Any, nodes: frozenset[str]) -> None:
    """Tell ``handler``'s :class:`PromptExecutor` (where it has one) the nodes its next join expects."""
    executor = getattr(handler, "_op_executor", None)
    if isinstance(executor, PromptExecutor):
        executor.expected = nodes
