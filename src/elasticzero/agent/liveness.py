"""Peer liveness: when a participant of the running round counts as gone (pure decisions, no I/O).

Every agent of a dynamic rendezvous writes a keep-alive heartbeat into the rendezvous state every
``keep_alive_interval`` (torch's ``DynamicRendezvousHandler``), and every read of the state drops a node whose last
heartbeat is older than ``keep_alive_interval * keep_alive_max_attempt`` (torch's ``_sanitize``). elasticzero makes
that age *the* peer timeout: :func:`peer_plan` derives the two keep-alive settings from ``--peer-timeout`` (or the
timeout from the settings a user wrote into ``--rdzv-conf``), and :func:`judge` applies torch's rule to a fresh read
of the heartbeats, so a node the agent finds gone is one the next rendezvous drops too (it never waits for it).
Heartbeats carry the writer's clock, as in torch: the nodes' clocks must agree well within the timeout (NTP).

:mod:`elasticzero.agent.peers` reads the snapshot (thin I/O); the verdict is one of the facts of the agent's monitor
tick (:mod:`elasticzero.agent.tick` decides what to do about it).
The trade-off of the timeout (docs/agent.md, "Peer liveness"): a frozen node is noticed after at most the timeout
plus a state read, and a live agent that cannot heartbeat for that long (a machine so loaded that a Python thread
waits seconds for a core, a stalled NFS home) is taken for gone; the job then re-forms without it and takes it back
when it joins again — a round change, never a lost job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticzero.errors import UsageError

#: seconds; torch drops a node after this much heartbeat silence (with a 1 s heartbeat: 4 beats)
DEFAULT_PEER_TIMEOUT_S = 4
#: a live node's last heartbeat can be up to two intervals old (torch's keep-alive timer restarts after each beat):
#: the timeout must span at least three, or a busy live node is dropped
MIN_BEATS = 3
#: heartbeats per timeout the derivation aims at (the interval is the largest whole divisor of the timeout that
#: still gives this many)
TARGET_BEATS = 4
#: torch's own keep-alive settings (``--torch-rdzv-defaults``): a 5 s beat, dropped after 3 missed: 15 s
TORCH_KEEP_ALIVE = (5, 3)
INTERVAL_KEY, ATTEMPT_KEY = "keep_alive_interval", "keep_alive_max_attempt"


@dataclass(frozen=True)
class PeerPlan:
    """How long a participant may be silent, and the rendezvous heartbeat that carries it."""

    timeout_s: int  #: ``interval_s * max_attempt``: torch drops a node silent for longer
    interval_s: int  #: ``keep_alive_interval``
    max_attempt: int  #: ``keep_alive_max_attempt``
    source: str  #: ``--peer-timeout``, ``--rdzv-conf``, ``default`` or ``--torch-rdzv-defaults``
    #: ``host:port`` of the c10d store when it lives in a node's agent (its silence is that node's); None: etcd
    store_in_agent: str | None = None

    def rdzv_conf(self) -> dict[str, str]:
        """The keep-alive keys of the rendezvous config."""
        return {INTERVAL_KEY: str(self.interval_s), ATTEMPT_KEY: str(self.max_attempt)}


def keep_alive_for(timeout_s: int) -> tuple[int, int]:
    """``(interval, max_attempt)`` whose product is exactly ``timeout_s``, with about :data:`TARGET_BEATS` beats."""
    divisors = [d for d in range(1, timeout_s // TARGET_BEATS + 1) if timeout_s % d == 0]
    interval = max(divisors, default=1)
    return interval, timeout_s // interval


def peer_plan(
    flag: str | None, user_conf: Mapping[str, str], torch_defaults: bool, store_in_agent: str | None = None
) -> PeerPlan:
    """``--peer-timeout`` (whole seconds), checked against keep-alive keys in ``--rdzv-conf``; else the timeout
    those keys give; else the default (torch's 15 s with ``--torch-rdzv-defaults``). ``store_in_agent``: the c10d
    store's ``host:port`` when an agent hosts it."""
    base = TORCH_KEEP_ALIVE if torch_defaults else keep_alive_for(DEFAULT_PEER_TIMEOUT_S)
    user = _user_keep_alive(user_conf)
    if flag is None:
        interval, attempt = user.get(INTERVAL_KEY, base[0]), user.get(ATTEMPT_KEY, base[1])
        source = "--rdzv-conf" if user else ("--torch-rdzv-defaults" if torch_defaults else "default")
        return PeerPlan(interval * attempt, interval, attempt, source, store_in_agent)
    timeout = parse_peer_timeout(flag)
    interval, attempt = keep_alive_for(timeout)
    if user and (user.get(INTERVAL_KEY, interval), user.get(ATTEMPT_KEY, attempt)) != (interval, attempt):
        given = ",".join(f"{k}={v}" for k, v in sorted(user.items()))
        raise UsageError(
            f"--peer-timeout {timeout} contradicts --rdzv-conf {given} (the peer timeout is keep_alive_interval * "
            f"keep_alive_max_attempt = {interval} * {attempt}): give one or the other"
        )
    return PeerPlan(timeout, interval, attempt, "--peer-timeout", store_in_agent)


def parse_peer_timeout(flag: str) -> int:
    """``--peer-timeout`` as whole seconds >= :data:`MIN_BEATS` (the launcher checks it with this too)."""
    try:
        timeout = int(flag)
    except ValueError:
        raise UsageError(
            f"--peer-timeout {flag!r}: give whole seconds (the rendezvous heartbeat is whole seconds)"
        ) from None
    if timeout < MIN_BEATS:
        raise UsageError(
            f"--peer-timeout {timeout}: must be >= {MIN_BEATS} s (at least {MIN_BEATS} one-second heartbeats; a live "
            "node's last heartbeat can be two beats old)"
        )
    return timeout


def _user_keep_alive(conf: Mapping[str, str]) -> dict[str, int]:
    """The keep-alive keys ``--rdzv-conf`` sets, as integers (bad values: the rendezvous options' own check)."""
    out = {}
    for key in (INTERVAL_KEY, ATTEMPT_KEY):
        if key in conf:
            try:
                out[key] = int(conf[key])
            except ValueError:
                raise UsageError(f"--rdzv-conf {key}={conf[key]!r} is not an integer") from None
    return out


# -- the verdict ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """What this node knows of its round: read from the rendezvous state (:mod:`elasticzero.agent.peers`)."""

    this_node: str  #: this agent's node descriptor (torch's ``addr_pid_localid``)
    round_nodes: frozenset[str]  #: the participants of the round this node's workers run in
    #: each node's last heartbeat in the state (POSIX seconds, the writer's clock); a node torch dropped is absent
    beats: Mapping[str, float]
    read_at: float  #: when the state was read (POSIX seconds, this node's clock)
    #: seconds the store has not answered for (0 when the last read did)
    store_wait_s: float = 0.0


@dataclass(frozen=True)
class Liveness:
    """The verdict: everyone alive, peers gone, this node itself dropped, or the store silent."""

    gone: tuple[str, ...] = ()  #: participants of the round silent past the timeout, or gone from the state
    self_gone: bool = False  #: this node was silent past the timeout: frozen or cut off, the others went on
    store_silent_s: float | None = None  #: the store has not answered for this long (past the timeout)

    @property
    def alive(self) -> bool:
        return not (self.gone or self.self_gone or self.store_silent_s is not None)


def silent(snap: Snapshot, node: str, timeout_s: float) -> bool:
    """torch's ``_sanitize`` rule: no heartbeat in the state, or the last one older than the timeout."""
    beat = snap.beats.get(node)
    return beat is None or snap.read_at - beat > timeout_s


def judge(snap: Snapshot, timeout_s: float, store_is_a_peer: bool) -> Liveness:
    """The verdict over one snapshot.

    A store that has not answered for ``timeout_s`` counts first when it lives in a peer (c10d: the agent of one
    node hosts it; that node is frozen or cut off, and no heartbeat can be read); then this node's own silence (it
    was frozen: the others dropped it and went on); then the round's participants silent past the timeout — the
    age at which every node's next read of the state drops them (torch's ``_sanitize``), so the round the agent
    re-forms never waits for them.
    """
    if store_is_a_peer and snap.store_wait_s > timeout_s:
        return Liveness(store_silent_s=snap.store_wait_s)
    if silent(snap, snap.this_node, timeout_s):
        return Liveness(self_gone=True)
    return Liveness(gone=tuple(sorted(n for n in snap.round_nodes if silent(snap, n, timeout_s))))


def node_host(node: str) -> str:
    """The address part of torch's node descriptor ``addr_pid_localid``."""
    return node.rsplit("_", 2)[0]


def gone_reason(gone: tuple[str, ...], plan: PeerPlan) -> str:
    """Why the round changes: which participants torch dropped."""
    names = ", ".join(f"{node_host(n)} ({n})" for n in gone)
    return (
        f"peer node(s) {names} silent for more than the peer timeout ({plan.timeout_s} s, {plan.source}) or gone "
        "from the rendezvous"
    )


def gone_line(gone: tuple[str, ...], plan: PeerPlan) -> str:
    """:func:`gone_reason`, and what the agent does about it (without live recovery)."""
    return f"{gone_reason(gone, plan)}; stopping this node's workers"


def dropped_line(plan: PeerPlan) -> str:
    """The line for this node found silent: the others dropped it and went on."""
    return (
        f"this node was dropped from the rendezvous (no heartbeat for {plan.timeout_s} s: it was frozen or cut off) "
        "and the others went on without it; stopping its workers and joining again as a new node"
    )


def store_lost_line(plan: PeerPlan, silent_s: float) -> str:
    """Why a c10d store's silence stops this node (the agent adds what it does next: agent/rejoin.py)."""
    return (
        f"the c10d rendezvous store at {plan.store_in_agent} has not answered for {silent_s:.1f} s (peer timeout "
        f"{plan.timeout_s} s): the node hosting it is frozen or cut off, or this node is (a c10d rendezvous cannot "
        "survive its store host; to train on when any node freezes, use an etcd rendezvous: --rdzv-endpoint "
        "etcd://HOST:2379)"
    )
