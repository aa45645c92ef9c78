"""Live recovery, the agent's side: hand the running workers the new round instead of restarting them.

With ``--live-recovery`` every rendezvous this agent completes (the job's first round, a restart after a real
failure, this node rejoining, a membership change) ends in a round file for this node's workers
(:data:`~elasticzero.rounds.ROUND_FILE_ENV`, format :class:`~elasticzero.rounds.NodeRound`): their new
global ranks, the world size, the store every member forms the round's default group on, and a prefix no other round
of the job uses. On a membership change the agent keeps its workers running (:mod:`elasticzero.agent.tick`'s
:class:`~elasticzero.agent.tick.HandOff`); they read the file and reconfigure in place (:mod:`elasticzero.live`).

The round number is agreed over the new rendezvous round's store (the protocol's keys and steps:
:mod:`elasticzero.rounds`): each agent sets the number of the last round it handed out (a joiner: none) under its
group rank, reads all of them, and takes the highest plus one — the same number on every node, above any round a
running worker has seen.

Pure decisions here (:func:`live_plan`, :func:`node_round`); :class:`RoundKeeper` is the thin I/O (the store exchange
and the file).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elasticzero.agent.agentdirs import agent_dir, make_private
from elasticzero.agent.liveness import PeerPlan
from elasticzero.agent.options import DYNAMIC_BACKENDS
from elasticzero.errors import UsageError
from elasticzero.rounds import (
    ROUND_FILE_ENV,
    NodeRound,
    StoreAddress,
    last_round_key,
    last_round_value,
    next_round_number,
    parse_last,
    round_prefix,
    write_round,
)

#: the agreement waits at most this many peer timeouts for every agent's number. An agent missing after that was
#: lost between the rendezvous and the agreement: its heartbeat is older than the timeout by then, so every agent,
#: having waited for the same missing key, rendezvouses again and the next round drops it (:func:`retry_agreement`)
AGREE_TIMEOUTS = 2
#: rendezvous attempts per round change whose agreement may fail so (then the agent fails with one line)
AGREE_TRIES = 3


class RoundAgreementError(RuntimeError):
    """The agents of a new round did not all publish their last round number in time."""


@dataclass(frozen=True)
class LivePlan:
    """``--live-recovery``: where this node's round file lives (one per agent and job)."""

    round_dir: str  #: the agent's private directory (created at the first round, removed when the agent ends)
    agree_timeout_s: float  #: how long the round-number agreement waits for the other agents

    @property
    def round_file(self) -> str:
        return os.path.join(self.round_dir, "round.json")

    def worker_env(self) -> dict[str, str]:
        """What every local worker gets: the path of this node's round file."""
        return {ROUND_FILE_ENV: self.round_file}


def live_plan(
    enabled: bool, backend: str, peers: PeerPlan | None, environ: Mapping[str, str], job_id: str, agent_pid: int
) -> LivePlan | None:
    """``--live-recovery`` checked against the rendezvous: it needs a dynamic one with peer liveness."""
    if not enabled:
        return None
    check_live_recovery(backend)
    if peers is None:
        raise UsageError(f"--live-recovery needs peer liveness, which --rdzv-backend {backend} does not offer")
    return LivePlan(agent_dir(environ, "round", job_id, agent_pid), AGREE_TIMEOUTS * peers.timeout_s)


def check_live_recovery(backend: str) -> None:
    """``--live-recovery`` with ``--rdzv-backend backend`` (the launcher checks it with this too)."""
    if backend not in DYNAMIC_BACKENDS:
        raise UsageError(
            f"--live-recovery needs a dynamic rendezvous (--rdzv-backend {' or '.join(sorted(DYNAMIC_BACKENDS))}, not "
            f"{backend}): a static one cannot re-form a round around running workers"
        )


def retry_agreement(tries_done: int) -> bool:
    """After a failed agreement: rendezvous again (a node was lost meanwhile), unless :data:`AGREE_TRIES` are spent."""
    return tries_done < AGREE_TRIES


@dataclass(frozen=True)
class RoundFacts:
    """What the rendezvous just completed gave this node (torch's worker group, read into plain values)."""

    ranks: tuple[tuple[int, int], ...]  #: ``(local_rank, global_rank)`` of this node's workers, any order
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  #: torch's ``use_agent_store``: the store is the agents' shared one, else rank 0 creates it
    group_rank: int = 0  #: this node's rank among the round's agents
    group_world_size: int = 1  #: the round's agents


def node_round(number: int, facts: RoundFacts) -> NodeRound:
    """The round file's content for round ``number``."""
    store = StoreAddress(facts.master_addr, facts.master_port, rank0_hosts=not facts.agent_store)
    return NodeRound(number, facts.world_size, tuple(sorted(facts.ranks)), store, round_prefix(number))


def handoff_line(number: int | None, world_size: int, why: str) -> str:
    """The one stderr line of a hand-off."""
    return f"elasticzero-run: {why}; handing the workers round {number} at world {world_size}, no restart"


# -- thin I/O ---------------------------------------------------------------------------------------------------------
class RoundKeeper:
    """This agent's round file and the last round it handed out."""

    def __init__(self, plan: LivePlan) -> None:
        self.plan = plan
        self.last: int | None = None

    def publish(self, store: Any, facts: RoundFacts) -> NodeRound:
        """Agree on the round number with the other agents of the round, then write this node's round file."""
        number = self._agree(store, facts.group_rank, facts.group_world_size)
        round_ = node_round(number, facts)
        make_private(self.plan.round_dir)  # the workers read their round here: this user's folder, not a link
        write_round(self.plan.round_file, round_)
        self.last = number
        return round_

    def _agree(self, store: Any, group_rank: int, group_world_size: int) -> int:
        keys = [last_round_key(r) for r in range(group_world_size)]
        store.set(keys[group_rank], last_round_value(self.last))
        try:
            store.wait(keys, timedelta(seconds=self.plan.agree_timeout_s))
        except Exception as exc:
            raise RoundAgreementError(
                f"the agents of the new round did not all publish their last round number within "
                f"{self.plan.agree_timeout_s:.0f} s ({exc}); a node was lost while the round formed"
            ) from exc
        return next_round_number([parse_last(raw) for raw in store.multi_get(keys)])

    def remove(self) -> None:
        """Remove the round file's directory (the agent is done)."""
        shutil.rmtree(self.plan.round_dir, ignore_errors=True)
