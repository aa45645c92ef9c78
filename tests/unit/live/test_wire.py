"""The wire: the one device a group's buddy-copy and reshard messages travel on (``comm.wire_for``), and the builders
that put them there (live/copies.py, live/reshard.py), checked without a GPU.

NCCL sends only CUDA tensors, so a host tensor handed to an NCCL group fails the live path at its first copy. On the
CPU the wire is the host and every tensor is on it anyway; here the builders are given ``torch.device("meta")`` as
the wire (a device that is not the host, with no data), so a buffer built on the host by mistake shows up as a CPU
tensor among meta ones. tests/integration/live/test_live_reshard.py checks every tensor handed to the real
communicators of a BuddyCopies and a reshard (real gloo ranks) is on the wire the rule gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage2
from elasticzero.engine.zero.comm.backends import p2p_batched, wire_for
from elasticzero.engine.zero.watch import Factor
from elasticzero.live.copies import (
    NOTE_LEN,
    BuddyCopies,
    WardCopy,
    bucket_exchange,
    grad_message,
    mirror_inbox,
    on,
    step_message,
)
from elasticzero.live.reshard import Transfer, _pack

CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.mark.parametrize(
    ("backend", "device", "want"),
    [
        ("nccl", "cuda:1", "cuda:1"),  # NCCL takes device tensors only: the optimizer's device
        ("NCCL", "cuda:0", "cuda:0"),
        ("gloo", "cpu", "cpu"),
        ("gloo", "cuda:1", "cpu"),  # gloo: the host, whatever the optimizer computes on
        ("mpi", "cuda:0", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda:1", "cpu"),  # a per-device group that names a backend for the host
        ("cuda:nccl", "cuda:1", "cuda:1"),  # ... and one that names none
        ("nccl", "cpu", "cpu"),  # a host optimizer has nothing else to send
        ("xccl", "xpu:0", "xpu:0"),  # another accelerator's backend: its device
    ],
)
def test_wire_rule(backend: str, device: str, want: str) -> None:
    assert wire_for(backend, torch.device(device)) == torch.device(want)


def test_exchanges_are_one_batch_wherever_gloo_does_not_serve_them() -> None:
    assert p2p_batched("nccl", "cuda") and p2p_batched("cpu:gloo,cuda:nccl", "cuda")
    assert not p2p_batched("gloo", "cpu") and not p2p_batched("cpu:gloo,cuda:nccl", "cpu")


def test_grad_message_is_built_on_the_wire() -> None:
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, dtype=torch.float64))
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    message = grad_message([a, b], META)
    assert [t.device for t in message] == [META] * 3
    assert [(t.shape, t.dtype) for t in message] == [((2,), torch.uint8), ((3,), torch.float32), ((2,), torch.float64)]
    here = grad_message([a, b], CPU)  # on the wire already: the gradient itself is sent, no copy
    assert here[1].data_ptr() == a.grad.data_ptr()


def test_step_message_is_built_on_the_wire() -> None:
    a = nn.Parameter(torch.ones(3))
    a.grad = torch.ones(3)
    clip = Factor(torch.tensor(0.5), as_tensor=True)  # a clip coefficient lives on the optimizer's device
    early = step_message([a], [clip], META, early=True)
    assert [(t.device, t.shape, t.dtype) for t in early] == [
        (META, (1,), torch.uint8),
        (META, (NOTE_LEN,), torch.float64),
    ]
    late = step_message([a], [], META, early=False)
    assert [t.device for t in late] == [META] * 3 and late[2].shape == (3,)


def test_mirror_inbox_is_flat_on_the_wire() -> None:
    own = [torch.zeros(2, 3), torch.zeros((), dtype=torch.float64)]
    box = mirror_inbox(own, META)
    assert [(t.device, t.shape, t.dtype) for t in box] == [(META, (6,), torch.float32), (META, (1,), torch.float64)]


def test_on_copies_only_off_the_device() -> None:
    t = torch.arange(4.0)
    assert on(t, CPU).data_ptr() == t.data_ptr() and on(t, META).device == META


def test_pack_is_on_the_wire_and_equals_the_concatenation() -> None:
    held = {0: torch.arange(10.0), 1: torch.arange(10.0, 20.0)}
    trees = {r: {"params": {"w": _Chunk(t)}} for r, t in held.items()}
    ts = [Transfer("w", 0, 0, 1, 2, 5, 2, 0), Transfer("w", 1, 0, 1, 4, 6, 1, 3)]
    want = torch.cat([held[0][2:5], held[1][1:3]])
    packed = _pack(trees, ts, "params", CPU)
    assert torch.equal(packed, want) and packed.dtype == want.dtype
    on_wire = _pack(trees, ts, "params", META)
    assert (on_wire.device, on_wire.shape) == (META, want.shape)


def test_ward_copy_inbox_on_the_wire_copies_on_the_host(group: None) -> None:
    opt = ZeroStage2(nn.Linear(3, 2), torch.optim.AdamW, lr=0.1)
    rep = BuddyCopies(opt, nodes=[0])  # one rank: nothing replicated, but the builders run on its wire
    assert rep.wire == CPU
    here = rep._empty_copy(0)
    hosts = [here.present, here.note, *here.grads]
    assert all(x is y for x, y in zip(here.inbox(), hosts, strict=True))  # received in place
    assert here.inbox(early=True) == hosts[:2]  # the gradients came during backward: present and the note only
    assert all(x is y for x, y in zip(here.wire_grads, here.grads, strict=True))  # early shards land in place too
    rep.wire = META  # as a device wire would be (NCCL: the optimizer's device)
    there = rep._empty_copy(0)
    assert {t.device for t in there.inbox()} == {META} and {t.device for t in there.wire_grads} == {META}
    assert [(t.shape, t.dtype) for t in there.inbox()] == [(t.shape, t.dtype) for t in here.inbox()]
    shadowed = [p for g in there.optim.param_groups for p in g["params"]]
    assert {t.device for t in (*there.masters, there.present, there.note, *there.grads, *shadowed)} == {CPU}
    rep.close()


def test_early_bucket_exchange_is_on_the_wire(group: None) -> None:
    """A bucket's shard sent during backward and the wards' receive buffers: on the wire (the device under NCCL, where
    the send is issued after the reduction's stream work); on the host wire the gradient itself, no copy."""
    opt = ZeroStage2(nn.Linear(3, 2), torch.optim.AdamW, lr=0.1)
    rep = BuddyCopies(opt, nodes=[0])
    shard = torch.ones(4)
    sends, recvs = bucket_exchange(0, shard, 1, {1: rep._empty_copy(1)}, CPU)
    assert sends[0][0].data_ptr() == shard.data_ptr() and sends[0][1] == 1 and recvs[0][1] == 1
    rep.wire = META
    sends, recvs = bucket_exchange(0, shard, 1, {1: rep._empty_copy(1)}, META)
    assert {t.device for t, _ in (*sends, *recvs)} == {META}
    assert bucket_exchange(0, shard, None, {}, META) == ([], [])  # no holder, no wards: nothing to post
    rep.close()


def test_land_copies_a_received_message_into_the_host_buffers() -> None:
    master = nn.Parameter(torch.zeros(3), requires_grad=False)
    shadow = torch.optim.SGD([master], lr=1.0)
    got = [torch.tensor([1.0, 2.0, 3.0])]
    copy = WardCopy(
        0,
        [master],
        shadow,
        [torch.zeros(3)],
        torch.zeros(1, dtype=torch.uint8),
        0,
        got,
        torch.ones(1, dtype=torch.uint8),
    )
    copy.land()
    assert copy.present.tolist() == [1] and torch.equal(copy.grads[0], got[0])
    copy.apply([{"lr": 1.0}])
    assert torch.equal(master.detach(), -got[0]) and copy.step == 1


class _Chunk:
    """A held state's chunk as :func:`reshard._chunk` reads it (``.tensor``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_a_host_mirror_lands_the_masters_in_the_copy_itself(group: None) -> None:
    """The first mirror's receive buffers: on the host wire a ward's masters land in its copy's own masters (no
    second buffer, and ``_install`` leaves them), everything else in new flat buffers laid out as this rank's state;
    on a device wire every buffer is on the wire."""
    opt = ZeroStage2(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)), torch.optim.AdamW, lr=0.1, bucket_bytes=16)
    opt.module(torch.ones(1, 3)).sum().backward()
    opt.step()  # every bucket has its moments and step: the layout has more than masters
    rep = BuddyCopies(opt, nodes=[0])
    rep.copies[0] = rep._empty_copy(0)
    own = rep._state_tensors(opt.masters, opt.optim.state)
    box = rep._landing(0, own)
    at = [0]
    for mine in opt.masters[:-1]:
        at.append(at[-1] + 1 + sum(torch.is_tensor(v) for v in opt.optim.state[mine].values()))
    assert len(opt.masters) > 1 and len(box) == len(own) > len(opt.masters)
    assert [box[i].data_ptr() for i in at] == [m.data_ptr() for m in rep.copies[0].masters]
    assert [(t.numel(), t.dtype) for t in box] == [(t.numel(), t.dtype) for t in own]
    assert {t.data_ptr() for i, t in enumerate(box) if i not in at}.isdisjoint({t.data_ptr() for t in own})
    rep.wire = META
    assert {t.device for t in rep._landing(0, own)} == {META}
    rep.close()
