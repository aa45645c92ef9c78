"""Redundant ZeRO shards: every rank's state has a current copy on its buddy (the holder), in host memory.

A :class:`BuddyCopies` on a ZeRO optimizer keeps, on every rank, a copy of the state of each of its *wards* (the ranks
:func:`~elasticzero.live.buddy.place_buddies` gives it): fp32 master shards, the wrapped optimizer's state
(moments, step counters), advanced by a shadow optimizer of the same class. Checkmate-style, the copies follow by
gradients, not by state: built, it mirrors each rank's state to its holder once; then in every optimizer step:

0. during backward (``early``, the default): as each bucket's reduction completes (the bucketer's ``on_reduced``, in
   the same bucket order on every rank: stages 1/2/3 all reduce during backward, stage 3 at its end), the rank posts
   that gradient shard to its holder and its wards' shards of the bucket into their inboxes, asynchronously
   (:meth:`ZeroOptimizer.watch_grads <elasticzero.engine.zero.base.ZeroOptimizer.watch_grads>`: the optimizer tells
   its watchers of reductions, of every in-place multiply of the shards — the loss scaler's unscale, the clip — as
   data (:class:`~elasticzero.engine.zero.watch.Factor`), and of ``zero_grad``). Before a shard is multiplied in place
   the posted sends complete (they read it); on a device wire each send is issued after its reduction's stream work;
1. at the step (pre-step hook on the wrapped optimizer): each rank waits for what it posted and sends its holder which
   buckets have a gradient and a *note* of the multiplies applied since (:func:`step_message`); the holder replays
   them, in order and kind, on the received shards (:meth:`WardCopy.replay`), so its gradient is bitwise the one the
   owner's step uses. Where a shard changed after it was posted — a bucket reduced twice in one step (accumulation by
   repeated backward, stage 3 always; under ``no_sync`` only the last backward reduces), or no backward since the last
   step — every rank sends its final gradient shards here instead (the pure decision :func:`early_grads_usable`; every
   rank decides alike: reductions are collectives). A step skipped for inf/NaN never reaches the hook; its
   ``zero_grad`` completes what was posted and starts afresh. In a live round the waits are the communicator's
   (bounded); a round change mid-backward abandons what is posted with the old group and its copies;
2. the *commit gate*: a one-element all-reduce; once it returns, every holder has the gradients of step N of all its
   wards, so every shard of step N can be made twice — step N is committed;
3. the wrapped optimizer steps (the owner's shard), then each holder steps its wards' copies with their gradients and
   the step's hyper-parameters (the same class, options and inputs: on the CPU the copy equals the owner's state
   bitwise) — by default on a background thread, overlapping the next forward and backward, joined before the next
   step's first receive and before anything reads the copies.

Why gradients, not state: a copy of the state after the step costs ``(1 + k) x`` the gradient's bytes (``k``
element-wise state tensors: Adam's two moments) and leaves a hole: once a rank has stepped, its state before the step
exists only on its holder, so losing the holder before the new copy lands loses that rank's committed step. With the
gate no rank updates its shard before every gradient of the step has its second copy: after a failure, every survivor
is either before the gate of step N (nothing of step N applied anywhere it survives) or past it (step N can be made
from the copies). A failure between the gate completing on one survivor and failing on another leaves survivors one
step apart; the reshard plan then reports it (:mod:`.reshard`), and the disk checkpoint is the fallback.

:meth:`BuddyCopies.held` is what this rank holds, as :class:`~elasticzero.engine.zero.sharded.ShardedState` s by old
rank (its own live state and its wards' copies), and :meth:`BuddyCopies.census` the steps they are at: what
:func:`~elasticzero.live.reshard.reshard_from` moves into a new optimizer at another world size.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.comm.backends import wire_for
from elasticzero.engine.zero.comm.communicator import Communicator, OwnsCommunicator
from elasticzero.engine.zero.comm.work import AnyWork, Waiter, same_memory
from elasticzero.engine.zero.sharded import ShardedState, is_shard_state
from elasticzero.engine.zero.watch import Factor
from elasticzero.live.buddy import BuddyPlan, place_buddies
from elasticzero.live.reshard import Holdings, Seed
from elasticzero.proc import AGENT_PID_ENV

#: Linux pids are below 2^22 (``PID_MAX_LIMIT``): a host hash shifted past them keeps every (host, pid) apart
PID_BITS = 22
#: the in-place multiplies of a step's gradients one note carries (a loss scaler's unscale, a clip: two); a step with
#: more sends its final gradients at the pre-step hook instead (:func:`early_grads_usable`)
MAX_FACTORS = 8
#: a step's note: ``[count, as_tensor_1, value_1, ..., as_tensor_MAX, value_MAX]`` (float64, exact for both kinds)
NOTE_LEN = 1 + 2 * MAX_FACTORS


def empty_note(pin: bool = False) -> torch.Tensor:
    """A note with no factors, on the host (``pin``: page-locked, for a device wire)."""
    return torch.zeros(NOTE_LEN, dtype=torch.float64, pin_memory=pin)


@dataclass
class WardCopy:
    """A holder's copy of ward ``rank``'s state: one master shard per bucket (host memory), the shadow optimizer over
    them, the ward's gradients (``grads``, ``present``: host memory, what the shadow steps with), the ``step`` the
    copy is at, and the receive buffers of a step's message on the wire (``wire_grads``, ``wire_present``: the host
    ones themselves when the wire is the host, else device buffers landed into them, :meth:`land`); ``note``: the
    in-place multiplies the ward applied to its gradients after sending them early (:func:`note_of`; none when they
    were sent final), replayed before the step."""

    rank: int
    masters: list[nn.Parameter]
    optim: torch.optim.Optimizer
    grads: list[torch.Tensor]
    present: torch.Tensor
    step: int
    wire_grads: list[torch.Tensor]
    wire_present: torch.Tensor
    note: torch.Tensor = field(default_factory=empty_note)
    wire_note: torch.Tensor = field(default_factory=empty_note)

    def inbox(self, early: bool = False) -> list[torch.Tensor]:
        """The buffers a step's message from the ward is received in at the pre-step hook, on the wire (see
        :func:`step_message`; ``early``: the gradients came during backward, :meth:`grad_inbox`)."""
        return [self.wire_present, self.wire_note, *([] if early else self.wire_grads)]

    def land(self) -> None:
        """Copy the received messages into the host buffers the shadow steps with (nothing when they are the same
        tensors: the wire is the host). From a device, asynchronous into pinned memory: the caller records an event
        after it and waits for that event before :meth:`apply`."""
        hosts = (self.present, self.note, *self.grads)
        for host, got in zip(hosts, (self.wire_present, self.wire_note, *self.wire_grads), strict=True):
            if host is not got:
                host.copy_(got, non_blocking=True)

    @torch.no_grad()
    def replay(self) -> None:
        """Apply the note's multiplies to the received gradients, in the ward's order and kind (:class:`Factor`): the
        gradients become bitwise the ward's at its step."""
        present = self.present.tolist()
        for i in range(int(self.note[0].item())):
            as_tensor, value = bool(self.note[1 + 2 * i].item()), self.note[2 + 2 * i]
            for g in (g for g, has in zip(self.grads, present, strict=True) if has):
                g.mul_(value.float().to(g.dtype) if as_tensor else value.item())

    @torch.no_grad()
    def apply(self, options: Sequence[Mapping[str, Any]]) -> None:
        """Step the copy with the received gradients (their note replayed first) and the owner's hyper-parameters of
        this step (``options``, one per parameter group, without ``params``: every rank's are the same, a scheduler
        moves them alike)."""
        self.replay()
        for m, g, has in zip(self.masters, self.grads, self.present.tolist(), strict=True):
            m.grad = g if has else None
        for mine, live in zip(self.optim.param_groups, options, strict=True):
            mine.update(live)
        self.optim.step()
        for m in self.masters:
            m.grad = None
        self.step += 1

    def nbytes(self) -> int:
        """Host bytes of this copy (masters, optimizer state, gradient buffers; not the device inbox)."""
        state = [t for s in self.optim.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in (*self.masters, *self.grads, *state))


def node_key(environ: Mapping[str, str], hostname: str) -> int:
    """This process's node as an integer, the same for every rank on it: under ``elasticzero-run`` its host and its
    agent's pid (:data:`~elasticzero.proc.AGENT_PID_ENV`: one agent per node for the node's life), else torchelastic's
    node rank (``GROUP_RANK``), else a hash of the host name. Not ``GROUP_RANK`` first: with ``--live-recovery`` the
    workers outlive their round and keep the one they started with, while the agents' group ranks are dealt afresh at
    every hand-off — two nodes may then carry the same one, and the copies would be placed as if on one node."""
    host, agent = zlib.crc32(hostname.encode()), environ.get(AGENT_PID_ENV, "")
    if agent.isdigit():
        return host << PID_BITS | int(agent)
    group_rank = environ.get("GROUP_RANK", "")
    return int(group_rank) if group_rank.isdigit() else host


def grad_message(masters: Sequence[nn.Parameter], wire: torch.device) -> list[torch.Tensor]:
    """What a rank sends its holder in a step with its final gradients, on the ``wire``
    (:func:`~elasticzero.engine.zero.comm.backends.wire_for`): which buckets have a gradient, then each bucket's
    gradient shard (as it is when it lives on the wire; zeros where there is none)."""
    grads = [
        on(m.grad, wire) if m.grad is not None else torch.zeros(m.shape, dtype=m.dtype, device=wire) for m in masters
    ]
    return [presence(masters, wire), *grads]


def presence(masters: Sequence[nn.Parameter], wire: torch.device) -> torch.Tensor:
    """Which buckets have a gradient (uint8 per bucket, on the ``wire``)."""
    return torch.tensor([m.grad is not None for m in masters], dtype=torch.uint8, device=wire)


def note_of(factors: Sequence[Factor], wire: torch.device) -> torch.Tensor:
    """The note of a step's in-place multiplies (at most :data:`MAX_FACTORS`), float64 on the ``wire``:
    ``[count, as_tensor_1, value_1, ...]``, zero-padded to :data:`NOTE_LEN` (a fp32 clip coefficient and a Python
    float both survive float64 exactly)."""
    note = torch.zeros(NOTE_LEN, dtype=torch.float64, device=wire)
    note[0] = len(factors)
    for i, f in enumerate(factors):
        note[1 + 2 * i] = float(f.as_tensor)
        note[2 + 2 * i] = f.value.detach().to(device=wire, dtype=torch.float64)
    return note


def step_message(
    masters: Sequence[nn.Parameter], factors: Sequence[Factor], wire: torch.device, early: bool
) -> list[torch.Tensor]:
    """What a rank sends its holder at the pre-step hook: which buckets have a gradient and the note of ``factors``;
    then, unless the gradients went ``early`` (during backward, as reduced; ``factors`` then say what happened to them
    since), the final gradients (:func:`grad_message`, ``factors`` already in them: send none)."""
    if early:
        return [presence(masters, wire), note_of(factors, wire)]
    present, *grads = grad_message(masters, wire)
    return [present, note_of(factors, wire), *grads]


def bucket_exchange(
    bucket: int, shard: torch.Tensor, holder: int | None, copies: Mapping[int, WardCopy], wire: torch.device
) -> tuple[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]]:
    """The sends and receives of one bucket's early exchange, on the ``wire``: this rank's gradient ``shard`` to its
    ``holder`` (itself when it lives on the wire), each ward's shard of ``bucket`` into that copy's inbox."""
    sends = [(on(shard, wire), holder)] if holder is not None else []
    return sends, [(c.wire_grads[bucket], w) for w, c in copies.items()]


def early_grads_usable(counts: Sequence[int], factors: int) -> bool:
    """Whether a step's gradients may go as they went during backward, each bucket's shard posted when its reduction
    completed, plus a note of the ``factors`` multiplies since: only when every bucket was reduced exactly once since
    the last step or ``zero_grad`` (``counts``, per bucket; every rank's are the same: reductions are collectives) —
    a second reduction (accumulation without ``no_sync``) changed a shard after it was posted, none (no backward) posted
    nothing — and the note holds them all. Otherwise the final gradients go at the pre-step hook."""
    return all(n == 1 for n in counts) and factors <= MAX_FACTORS


@dataclass
class GradWindow:
    """What happened to this rank's gradient shards since its last step or ``zero_grad``: reductions per bucket
    (``counts``), the in-place multiplies (``factors``, in order), the early exchanges posted (``posted``)."""

    counts: list[int]
    factors: list[Factor] = field(default_factory=list)
    posted: list[AnyWork] = field(default_factory=list)

    @classmethod
    def opened(cls, buckets: int) -> GradWindow:
        """A window with nothing yet: no bucket reduced, no multiply, nothing posted."""
        return cls([0] * buckets)


def mirror_inbox(own: Sequence[torch.Tensor], wire: torch.device) -> list[torch.Tensor]:
    """Receive buffers on the ``wire`` for a ward's mirrored state, laid out as this rank's own (``own``: its
    :meth:`BuddyCopies._state_tensors`, every rank's the same shapes), flat."""
    return [torch.empty(t.numel(), dtype=t.dtype, device=wire) for t in own]


def on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` detached, on ``device``: itself when it is there, else a copy."""
    return t.detach() if t.device == device else t.detach().to(device)


class BuddyCopies(OwnsCommunicator):
    """Keeps a copy of every rank's ZeRO state on its buddy, current at the last committed step (see the module).

    Args:
        opt: the ZeRO optimizer (any stage); its wrapped optimizer gets two step hooks.
        nodes: the node of every rank of ``opt``'s group (default: gathered, :func:`node_key` of each rank).
        enabled: replication on (default) or off; with one node it is off whatever this says.
        node_shift: copies go ``node_shift`` nodes further in the node ring (a round whose node count divides it: 1).
        step: the training step ``opt``'s state is at (the census reports steps from there).
        overlap: step the copies on a background thread, overlapping this rank's next forward and backward (joined
            before the next exchange and by every method that reads the copies); False: inside ``opt.step()``.
        waiter: how the copies' communicator waits (:data:`~elasticzero.engine.zero.comm.work.Waiter`; a bounded
            wait for live reconfiguration).
        early: post each bucket's gradient shard to the holder as soon as its reduction completes during backward
            (:meth:`ZeroOptimizer.watch_grads <elasticzero.engine.zero.base.ZeroOptimizer.watch_grads>`), overlapping
            the rest of backward; the pre-step hook then waits for them and sends a note of what happened to the
            gradients since (:func:`early_grads_usable` decides per step). False: every gradient at the pre-step hook.
        seed: what this rank kept of the round's reshard (:class:`~elasticzero.live.reshard.Seed`): a ward whose
            whole state this rank sent it there gets its copy made here from the same elements instead of mirrored
            back (:attr:`seeded`), and a rank whose holder sent it its whole state sends no mirror.

    Collective: every rank of ``opt``'s group builds one at the same point (it mirrors the current state to the
    holders). BuddyCopies has its own :class:`Communicator` on ``opt.process_group`` (``copies.comm_stats``:
    the copies' bytes, apart from the training collectives': ops ``send``/``recv``, ``all_reduce`` of the gate; tag
    ``"copies"``)."""

    def __init__(
        self,
        opt: ZeroOptimizer,
        *,
        nodes: Sequence[Hashable] | None = None,
        enabled: bool = True,
        node_shift: int = 1,
        step: int = 0,
        overlap: bool = True,
        waiter: Waiter | None = None,
        early: bool = True,
        seed: Seed | None = None,
    ) -> None:
        self.opt = opt
        #: the wards whose first copy this rank made from the seed (not mirrored)
        self.seeded: frozenset[int] = frozenset()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ez-copies") if overlap else None
        self._applying: Future[None] | None = None
        self._communicator = Communicator(opt.process_group, owner="BuddyCopies", waiter=waiter)
        #: the device every message travels on: the optimizer's under NCCL, the host under gloo (the copies and the
        #: shadow optimizers stay on the host either way)
        self.wire = wire_for(self.communicator.backend, opt.device)
        self._landed: Any = None  # the event after this step's messages were landed on the host (CUDA wire only)
        self.rank = opt.rank
        self.step = step
        found = list(nodes) if nodes is not None else self._gather_nodes()
        self.plan: BuddyPlan = place_buddies(found, enabled=enabled, node_shift=node_shift)
        self.holder = self.plan.holder[self.rank]
        self.copies = {w: self._empty_copy(w) for w in self.plan.wards(self.rank)}
        self._window = GradWindow.opened(len(opt.masters))
        #: steps whose gradients went to the holder during backward (the others' at the pre-step hook)
        self.early_steps = 0
        self._hooks: list[Any] = [opt.optim.register_step_post_hook(self._after_step)]  # counts steps, even off
        if self.plan.enabled:
            self._mirror(seed)
            self._hooks.append(opt.optim.register_step_pre_hook(self._before_step))
        if self.plan.enabled and early:
            self._hooks.append(opt.watch_grads(self))

    # -- what this rank holds -----------------------------------------------------------------------------------------
    def census(self) -> dict[int, int]:
        """``{rank: step}`` of every state this rank holds (its own, its wards' copies), ranks of ``opt``'s group."""
        self._join()
        return {self.rank: self.step, **{w: c.step for w, c in self.copies.items()}}

    def held(self) -> dict[int, ShardedState]:
        """The states of :meth:`census` (views, nothing copied): this rank's live state and its wards' copies."""
        self._join()
        return {self.rank: self.opt.sharded_state(), **{w: self._state_of(c) for w, c in self.copies.items()}}

    def holdings(self) -> Holdings:
        """:meth:`held` and :meth:`census` with this rank as their owner: what it brings to
        :func:`~elasticzero.live.reshard.reshard_from` in a new group."""
        return Holdings(self.rank, self.held(), self.census())

    def nbytes(self) -> int:
        """Host bytes of the copies this rank holds."""
        self._join()
        return sum(c.nbytes() for c in self.copies.values())

    def close(self) -> None:
        """Remove the step hooks and close the communicator (the copies stay readable through :meth:`held`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._join()
        if self._worker is not None:
            self._worker.shutdown()
        self.communicator.close()

    def abandon(self) -> None:
        """Let go of the copies of a round left for good (their holdings read already), waiting for nothing: the step
        hooks off, the worker thread told to end after what it runs. Not :meth:`close`, which waits for the copies'
        step in flight and closes the communicator — either may wait on the old group, which a lost peer can leave
        waiting (or raise) for good."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)

    # -- the gradients during backward (GradWatcher) ----------------------------------------------------------------
    def grads_changing(self, bucket: int | None) -> None:
        """Before a shard is written in place: an early send still reading it (a re-reduced bucket's, or any before
        an unscale or clip) completes first."""
        if bucket is None or self._window.counts[bucket]:
            self._wait_posted()

    def grad_reduced(self, bucket: int, shard: torch.Tensor) -> None:
        """A bucket's first reduction since the last step: post its shard to the holder and the wards' shards of it
        into their inboxes (every rank reduces the buckets in the same order, so the posts match), asynchronously. On
        a device wire the send is issued after the reduction's stream work (the bucketer waited for it)."""
        counts = self._window.counts
        counts[bucket] += 1
        if counts[bucket] != 1:
            return
        self._join()  # the copies' previous step reads the host gradient buffers the wards' shards arrive in
        sends, recvs = bucket_exchange(bucket, shard, self.holder, self.copies, self.wire)
        work = self.communicator.exchange(sends, recvs, async_op=True) if sends or recvs else None
        if work is not None:
            self._window.posted.append(work)

    def grads_scaled(self, factor: Factor) -> None:
        self._window.factors.append(factor)

    def grads_dropped(self) -> None:
        """``zero_grad`` (after a step, or after a step skipped for inf/NaN): a new window."""
        self._wait_posted()
        self._window = GradWindow.opened(len(self.opt.masters))

    def _wait_posted(self) -> None:
        """Complete the early exchanges posted (through the communicator's waiter: bounded in a live round)."""
        posted, self._window.posted = self._window.posted, []
        for work in posted:
            work.wait()
        if posted:
            self.communicator.settle()

    # -- the step -----------------------------------------------------------------------------------------------------
    def _before_step(self, optim: Any, args: Any, kwargs: Any) -> None:
        self._join()  # the copies' previous step: its gradient buffers receive this step's
        self._wait_posted()
        window, self._window = self._window, GradWindow.opened(len(self.opt.masters))
        early = early_grads_usable(window.counts, len(window.factors))
        self.early_steps += early
        recvs = [(t, w) for w, c in self.copies.items() for t in c.inbox(early)]
        self.communicator.exchange(self._step_sends(window.factors if early else [], early), recvs)
        wire = self.wire
        gate = torch.ones(1, device=wire)
        self.communicator.all_reduce(gate, op=dist.ReduceOp.MIN, tag="copies")  # the commit gate
        if wire.type != "cpu":  # NCCL's wait only orders the stream: the step counts as committed once the host saw
            gate.item()  # the gate complete (a peer lost there: the round watch aborts the group, and this raises)
        self._landed = self._land()

    def _step_sends(self, factors: Sequence[Factor], early: bool) -> list[tuple[torch.Tensor, int]]:
        """This rank's pre-step message to its holder (:func:`step_message`; nothing without a holder)."""
        holder = self.holder
        if holder is None:
            return []
        return [(t, holder) for t in step_message(self.opt.masters, factors, self.wire, early)]

    def _land(self) -> Any:
        """The wards' messages into their host buffers; on a CUDA wire an event recorded after the copies (issued on
        the current stream, after the receives: the shadow step waits for it, this thread does not)."""
        for c in self.copies.values():
            c.land()
        return _recorded_event() if self.wire.type == "cuda" and self.copies else None

    def _after_step(self, optim: Any, args: Any, kwargs: Any) -> None:
        self.step += 1  # the census's step of this rank's own state, copies or not
        if not self.copies:
            return
        options = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.optim.param_groups]  # this step's
        landed, self._landed = self._landed, None
        if self._worker is None:
            self._apply(options, landed)
        else:
            self._applying = self._worker.submit(self._apply, options, landed)

    def _apply(self, options: list[dict[str, Any]], landed: Any) -> None:
        """Step every copy (``landed``: the event after this step's messages reached the host, or None)."""
        if landed is not None:
            landed.synchronize()
        for c in self.copies.values():
            c.apply(options)

    def _join(self) -> None:
        """Wait for the copies' step in flight (its error, if any, is raised here)."""
        applying, self._applying = self._applying, None
        if applying is not None:
            applying.result()

    # -- building -----------------------------------------------------------------------------------------------------
    def _gather_nodes(self) -> list[int]:
        mine = torch.tensor([node_key(os.environ, socket.gethostname())], dtype=torch.int64, device=self.wire)
        out = torch.empty(self.communicator.size, dtype=torch.int64, device=self.wire)
        self.communicator.all_gather(out, mine, tag="copies")
        return out.tolist()

    def _empty_copy(self, ward: int) -> WardCopy:
        """Buffers for ``ward``'s copy, laid out as its shards (every rank's shard of a bucket has the same size): on
        the host, and the inbox on the wire (the host buffers themselves when the wire is the host; else one gradient
        shard per bucket on the device, and the host ones pinned, so landing them does not block)."""
        masters = [nn.Parameter(torch.empty(m.shape, dtype=m.dtype), requires_grad=False) for m in self.opt.masters]
        groups = []
        for gi, g in enumerate(self.opt.optim.param_groups):
            params = [masters[i] for i in self.opt.layout.group_buckets(gi)]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
        make: Any = type(self.opt.optim)  # the wrapped optimizer's class, built on the copies' parameter groups
        shadow = make(groups)
        pin = self.wire.type == "cuda"
        grads = [torch.empty(m.shape, dtype=m.dtype, pin_memory=pin) for m in masters]
        present, note = torch.empty(len(masters), dtype=torch.uint8, pin_memory=pin), empty_note(pin)
        if self.wire.type == "cpu":
            return WardCopy(ward, masters, shadow, grads, present, self.step, grads, present, note, note)
        inbox = [torch.empty_like(g, device=self.wire) for g in grads]
        wire_present, wire_note = (torch.empty_like(t, device=self.wire) for t in (present, note))
        return WardCopy(ward, masters, shadow, grads, present, self.step, inbox, wire_present, note, wire_note)

    @torch.no_grad()
    def _mirror(self, seed: Seed | None) -> None:
        """Send this rank's state to its holder, receive the wards' (the starting point the gradients advance), on the
        wire; the received tensors land in the host copies. Where the round's reshard left a seed, a ward this rank
        sent its whole state there is not mirrored back: its copy is made here (:meth:`_seed_box`) while the other
        messages travel (every rank decides alike: the plan is the same everywhere)."""
        own = self._state_tensors(self.opt.masters, self.opt.optim.state)
        self.seeded = frozenset(w for w in self.copies if seed is not None and seed.serves(w, self.rank))
        served = seed is not None and self.holder is not None and seed.serves(self.rank, self.holder)
        holder = None if served else self.holder  # the holder made this rank's copy itself
        sends = [(on(t, self.wire).reshape(-1), holder) for t in own] if holder is not None else []
        inboxes = {w: self._landing(w, own) for w in self.copies if w not in self.seeded}
        recvs = [(t, w) for w, box in inboxes.items() for t in box]
        work = self.communicator.exchange(sends, recvs, async_op=True)
        for w in self.seeded:
            assert seed is not None
            self._install(self.copies[w], self._seed_box(seed, w))
        if work is not None:
            work.wait()
            self.communicator.settle()
        for w, box in inboxes.items():
            self._install(self.copies[w], box)

    def _landing(self, ward: int, own: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Where ``ward``'s mirror is received (:func:`mirror_inbox`, laid out as ``own``); on the host wire its masters
        land in the copy's own masters (:meth:`_install` then leaves them: no second buffer, no copy)."""
        if self.wire.type != "cpu":
            return mirror_inbox(own, self.wire)
        masters, at = {}, 0
        for m, mine in zip(self.copies[ward].masters, self.opt.masters, strict=True):
            masters[at] = m.detach().view(-1)
            at += 1 + sum(torch.is_tensor(v) for v in self.opt.optim.state.get(mine, {}).values())
        return [masters[i] if i in masters else mirror_inbox([t], self.wire)[0] for i, t in enumerate(own)]

    def _seed_box(self, seed: Seed, ward: int) -> list[Any]:
        """What ``ward``'s mirror would bring (laid out as :meth:`_state_tensors`), made from the seed: the masters
        written straight into the copy's own (:meth:`_install` then leaves them), every element-wise state tensor
        into a new host buffer the copy adopts, the others (a step counter: every rank's is the same) copies of this
        rank's own."""
        opt, copy = self.opt, self.copies[ward]
        states = [opt.optim.state.get(m, {}) for m in opt.masters]
        seed.fill(ward, opt.layout, "params", {i: m.detach() for i, m in enumerate(copy.masters)})
        boxes: dict[tuple[int, str], torch.Tensor] = {}
        for key in sorted({k for st in states for k in st}):
            like = {i: st[key] for i, st in enumerate(states) if key in st and torch.is_tensor(st[key])}
            shard = {i: t for i, t in like.items() if is_shard_state(t, opt.masters[i])}
            out = {i: torch.empty(t.numel(), dtype=t.dtype) for i, t in shard.items()}
            seed.fill(ward, opt.layout, key, out)
            boxes |= {(i, key): out[i] if i in out else t.detach().cpu().clone() for i, t in like.items()}
        box: list[Any] = []
        for i, (m, st) in enumerate(zip(copy.masters, states, strict=True)):
            box += [m.detach(), *(boxes[i, k] for k in sorted(st) if torch.is_tensor(st[k]))]
        return box

    def _state_tensors(self, masters: Sequence[torch.Tensor], state: Mapping[Any, Mapping[str, Any]]) -> list[Any]:
        """Per bucket: the master, then its optimizer state's tensors by sorted key (the order both sides agree on:
        every rank's wrapped optimizer has stepped the same buckets)."""
        out: list[Any] = []
        for m in masters:
            st = state.get(m, {})
            out += [m.detach(), *(st[k] for k in sorted(st) if torch.is_tensor(st[k]))]
        return out

    def _install(self, copy: WardCopy, box: list[torch.Tensor]) -> None:
        """Fill ``copy`` from the mirrored tensors (laid out as :meth:`_state_tensors`; non-tensor state values are
        this rank's own, the same everywhere). Everything lands on the host: the received buffers themselves when the
        wire is the host, else copies (no device tensor in a shadow optimizer)."""
        it = iter(box)
        for m, mine in zip(copy.masters, self.opt.masters, strict=True):
            got = next(it)
            if not same_memory(got, m):  # a seeded copy's, a host mirror's masters are in place already
                m.data.copy_(got)
            st = self.opt.optim.state.get(mine, {})
            if st:
                copy.optim.state[m] = {
                    k: on(next(it), torch.device("cpu")).reshape(v.shape) if torch.is_tensor(v) else v
                    for k, v in sorted(st.items())
                }

    def _state_of(self, copy: WardCopy) -> ShardedState:
        opt = self.opt
        return ShardedState.of(
            opt.layout,
            copy.rank,
            [m.detach() for m in copy.masters],
            [copy.optim.state.get(m, {}) for m in copy.masters],
            origin=opt.origin,
            aliases=opt.tied_aliases(),
            param_groups=opt.optim.param_groups,
            module=opt.module_state(),
        )


def _recorded_event() -> Any:
    """A CUDA event recorded on the current stream now."""
    event = torch.cuda.Event()
    event.record()
    return event
