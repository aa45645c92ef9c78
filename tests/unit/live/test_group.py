"""Forming a round's group: the decision (backend, rank, store, device, timeout; how the old group is left) is pure;
one process forms a fresh default group twice over a real TCPStore (a world of one: the same member twice, what
``new_group`` cannot)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticzero.device import Facts, placement
from elasticzero.live.bounded import LiveError
from elasticzero.live.group import (
    GroupSpec,
    RoundGroups,
    RoundWatch,
    abandon_calls,
    aborts_on_announce,
    arrive,
    closed,
    cut,
    group_spec,
    init_args,
    socket_fds,
)
from elasticzero.rounds import NodeRound, RoundFile, StoreAddress, arrival_key, write_round
from ez_testing import free_port

pytestmark = pytest.mark.timeout(60)

CPU = placement(Facts(False, 0, {"LOCAL_RANK": "1"}))
GPU = placement(Facts(True, 2, {"LOCAL_RANK": "1", "ELASTICZERO_COLLECTIVE_TIMEOUT": "90"}))


def round_(rank0_hosts: bool = False, number: int = 1) -> NodeRound:
    return NodeRound(number, 4, ((0, 2), (1, 0)), StoreAddress("10.1.1.1", 29400, rank0_hosts), f"r{number}/")


def test_on_the_cpu_a_round_is_a_gloo_default_group_at_the_new_rank() -> None:
    spec = group_spec(round_(), 0, CPU)
    assert spec == GroupSpec("gloo", 2, 4, "10.1.1.1", 29400, False, "r1/", None, None)


def test_with_cuda_it_is_nccl_bound_to_the_local_device_with_the_launchers_timeout() -> None:
    spec = group_spec(round_(), 1, GPU)
    assert (spec.backend, spec.rank, spec.device, spec.timeout) == ("nccl", 0, "cuda:1", timedelta(seconds=90))
    assert group_spec(round_(), 1, GPU, timedelta(seconds=5)).timeout == timedelta(seconds=5)  # the caller's wins


def test_init_process_group_binds_nccl_to_the_device_and_leaves_gloo_unbound() -> None:
    nccl, gloo = init_args(group_spec(round_(), 1, GPU)), init_args(group_spec(round_(), 0, CPU))
    assert nccl == {
        "backend": "nccl",
        "rank": 0,
        "world_size": 4,
        "timeout": timedelta(seconds=90),
        "device_id": torch.device("cuda:1"),
    }
    assert (gloo["backend"], gloo["rank"], gloo["device_id"], gloo["timeout"]) == ("gloo", 2, None, None)


def test_the_new_rank_0_hosts_the_store_only_when_the_round_says_so() -> None:
    assert group_spec(round_(rank0_hosts=True), 1, CPU).store_master
    assert not group_spec(round_(rank0_hosts=True), 0, CPU).store_master  # rank 2
    assert not group_spec(round_(rank0_hosts=False), 1, CPU).store_master  # the agent's store


def test_a_local_rank_the_round_does_not_name_is_a_live_error() -> None:
    with pytest.raises(LiveError, match="local rank 5 is not in round 1"):
        group_spec(round_(), 5, CPU)


def test_nccl_is_aborted_before_it_is_destroyed_gloo_only_destroyed() -> None:
    assert abandon_calls("nccl") == ("abort", "destroy")
    assert abandon_calls("gloo") == ("destroy",)
    assert abandon_calls("nccl", aborted=True) == ("destroy",)  # the round watch aborted it already


def test_only_nccl_is_aborted_by_a_watch_at_the_announcement() -> None:
    """NCCL's waits return before the device is done (a stuck kernel blocks a later sync, unbounded): its group is
    aborted as the round is announced; gloo's waits block the host and the bound leaves them."""
    assert aborts_on_announce("nccl") and not aborts_on_announce("gloo")


def test_the_round_watch_fires_once_at_the_announcement_and_not_after_close(tmp_path: Path) -> None:
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", 1234, True)
    write_round(path, NodeRound(3, 2, ((0, 0),), store, "r3/"))
    rounds, calls = RoundFile(path), []
    watch = RoundWatch(lambda: rounds.poll(3), lambda: calls.append(time.monotonic()), poll_s=0.01)
    time.sleep(0.1)
    assert calls == [] and not watch.fired  # the current round is not news
    announced = time.monotonic()
    write_round(path, NodeRound(4, 1, ((0, 0),), store, "r4/"))
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    assert watch.fired and len(calls) == 1 and calls[0] - announced < 1.0  # a poll or two (10 ms), scheduling
    write_round(path, NodeRound(5, 1, ((0, 0),), store, "r5/"))
    time.sleep(0.1)
    assert len(calls) == 1  # once
    quiet = RoundWatch(lambda: rounds.poll(5), lambda: calls.append(0.0), poll_s=0.01)
    quiet.close()
    write_round(path, NodeRound(6, 1, ((0, 0),), store, "r6/"))
    time.sleep(0.1)
    assert not quiet.fired and len(calls) == 1  # closed first: never fires


def test_one_process_forms_a_fresh_default_group_per_round_and_keeps_the_old_ones_until_cut() -> None:
    port = free_port()
    groups = RoundGroups()
    specs = [GroupSpec("gloo", 0, 1, "127.0.0.1", port, True, f"r{n}/", None, timedelta(seconds=30)) for n in (0, 1)]
    first = groups.form(specs[0])
    assert first is dist.group.WORLD and dist.get_world_size() == 1
    second = groups.form(specs[1])  # the same member again: the first one destroyed, a new default group
    assert second is dist.group.WORLD and second is not first and groups.abandoned == [first]
    dist.all_reduce(t := torch.ones(1))  # the new group works
    assert t.item() == 1
    assert len(groups._stores) == 1  # the store this process hosts is reused, not created again on the same port
    groups.abandon()
    assert not dist.is_initialized() and groups.abandoned == [first, second]
    assert groups.sockets == {} and len(groups._left) == 2  # gloo: each left with the connections it opened
    groups.cut_left()
    assert len(groups.abandoned) == 2 and groups._left == []  # cut, still referenced
    groups.let_go()
    assert groups.abandoned == []  # let go (on a thread of their own)


class Leave(Exception):
    """What the tests' ``check`` raises (the live loop's bound raises ``Reconfigure``)."""


def leave_after(polls: int) -> Callable[[], None]:
    """A ``check`` that raises :class:`Leave` at its ``polls``-th call (a newer round announced by then)."""
    calls = [0]

    def check() -> None:
        calls[0] += 1
        if calls[0] >= polls:
            raise Leave

    return check


def test_members_form_only_once_all_arrived_and_a_missing_one_is_left_by_the_check() -> None:
    store = dist.PrefixStore("r7/", dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False))
    with pytest.raises(Leave):  # rank 1 never comes: rank 0 polls, and leaves at the check's word
        arrive(store, 0, 2, leave_after(3), poll_s=0.01)
    other = threading.Timer(0.1, lambda: store.set(arrival_key(1), "1"))
    other.start()
    start = time.monotonic()
    arrive(store, 0, 2, lambda: None, poll_s=0.01)  # returns once rank 1 arrived
    assert 0.1 <= time.monotonic() - start < 5.0


def test_a_store_that_is_not_there_is_tried_until_the_check_leaves() -> None:
    spec = GroupSpec("gloo", 1, 2, "127.0.0.1", free_port(), False, "r3/", None, timedelta(seconds=30))
    groups = RoundGroups()
    start = time.monotonic()
    with pytest.raises(Leave):
        groups.form(spec, check=leave_after(2))  # two tries of the connection, then the newer round
    assert time.monotonic() - start < 10.0 and groups.current is None and not dist.is_initialized()


def test_a_member_switches_only_once_every_member_said_it_is_ready() -> None:
    """The round protocol's *ready* step: a member of the old round asks each time it polls (and trains on meanwhile);
    a store nobody serves yet (its host, the new rank 0, is a joiner still starting) is a no at once, without a
    wait; once the joiner's store is up and it said it is ready, the member says so too and both are."""
    port = free_port()
    survivor = GroupSpec("gloo", 1, 2, "127.0.0.1", port, False, "r5/", None, timedelta(seconds=30))
    joiner = GroupSpec("gloo", 0, 2, "127.0.0.1", port, True, "r5/", None, timedelta(seconds=30))
    groups, host = RoundGroups(), RoundGroups()
    start = time.monotonic()
    assert groups.ready(survivor, "4:0") is None  # nothing listens there yet
    assert time.monotonic() - start < 1.0 and groups._stores == {}
    assert host.ready(joiner, "new") is None  # the joiner serves the store and said it; the survivor has not yet
    store = dist.PrefixStore("r5/", host._stores[("127.0.0.1", port)])
    assert store.check(["ready/0"]) and not store.check(["ready/1"])
    assert groups.ready(survivor, "4:0") == ["new", "4:0"]  # says it, and finds the joiner's: both ready, by rank
    assert host.ready(joiner, "new") == ["new", "4:0"] and store.check(["ready/0", "ready/1"])


def test_the_first_proposal_of_a_switch_step_is_every_members() -> None:
    """The round protocol's *switch* step: the first member's proposal is set, a later one adopts it; a member that
    does not propose (the NCCL watch's thread) reads it, or nothing before it is there."""
    port = free_port()
    a = GroupSpec("gloo", 0, 2, "127.0.0.1", port, True, "r6/", None, timedelta(seconds=30))
    b = GroupSpec("gloo", 1, 2, "127.0.0.1", port, False, "r6/", None, timedelta(seconds=30))
    host, other = RoundGroups(), RoundGroups()
    assert host.ready(a, "5:0") is None and other.ready(b, "5:1") == ["5:0", "5:1"]
    assert host.switch_at(a, None) is None  # nobody proposed yet
    assert other.switch_at(b, 9) == 9 and host.switch_at(a, 8) == 9 and host.switch_at(a, None) == 9


def test_a_closed_socket_of_the_recorded_ones_is_a_lost_connection() -> None:
    """The decision: a recorded socket gone, or its descriptor reused by another socket; new sockets do not count."""
    recorded = {7: "socket:[100]", 9: "socket:[101]"}
    assert not closed(recorded, {7: "socket:[100]", 9: "socket:[101]", 12: "socket:[300]"})
    assert closed(recorded, {7: "socket:[100]"})
    assert closed(recorded, {7: "socket:[100]", 9: "socket:[555]"})
    assert not closed({}, {})


def test_socket_fds_sees_this_process_s_sockets_open_and_closed() -> None:
    import socket

    sock = socket.socket()
    fd, link = sock.fileno(), socket_fds()[sock.fileno()]
    assert link.startswith("socket:[")
    sock.close()
    assert socket_fds().get(fd) != link


def test_a_formed_group_records_its_connections_and_leaving_it_forgets_them() -> None:
    """A world of one has no peer connections to lose (gloo may open none): never lost; after leaving, nothing."""
    groups = RoundGroups()
    groups.form(GroupSpec("gloo", 0, 1, "127.0.0.1", free_port(), True, "r9/", None, timedelta(seconds=30)))
    try:
        assert not groups.lost()
    finally:
        groups.abandon()
    assert groups.sockets == {} and not groups.lost()


def test_cut_shuts_down_the_recorded_connections_only(tmp_path: Path) -> None:
    """A connection recorded and still open is shut down (its peer reads the end); a listening socket (gloo's
    listener thread dies of a failed accept) and a descriptor closed and reused since (here by a file) are left."""
    a, b = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    stale = socket.socket()
    stale_link = os.readlink(f"/proc/self/fd/{stale.fileno()}")
    number = stale.fileno()
    stale.close()
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)  # the lowest free number: the socket's, reused
    if fd != number:
        os.dup2(fd, number)
        os.close(fd)
    links = socket_fds()
    recorded = {a.fileno(): links[a.fileno()], listener.fileno(): links[listener.fileno()], number: stale_link}
    assert cut(recorded) == 1
    assert os.fstat(number).st_size == 0  # the file untouched, still open
    os.close(number)
    b.settimeout(5)
    assert b.recv(1) == b""  # the peer of the cut connection reads the end
    with socket.create_connection(listener.getsockname(), timeout=5):
        pass  # the listener still accepts
    for s in (a, b, listener):
        s.close()
