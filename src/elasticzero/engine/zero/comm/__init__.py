"""Engine collectives: each engine object issues, counts and settles its collectives through its own
:class:`Communicator`.

A ZeRO optimizer (shared with the :class:`~elasticzero.engine.bucketer.GradBucketer` it drives) and a stand-alone
bucketer each hold one, as ``obj.communicator``; a :class:`~elasticzero.engine.loss_scaler.LossScaler` holds one for the
group it was given, else opens one per agreement on the group it needs. A communicator owns all the state its
collectives need: its process group (held weakly), its :class:`CommStats`, the asynchronous collectives it issued
and has not seen completed, the aliases waiting to be settled (:meth:`Communicator.settle`), the ring decision (made
once, when it is built) and its ring tag sequence. Nothing in this module changes at run time.

:meth:`Communicator.close` completes what is pending, settles and detaches from the group; using it afterwards raises
a :class:`~elasticzero.errors.UsageError`. An engine object's communicator can be replaced by one on another group of
the same ranks (a rebuilt group, in a running process)::

    opt.communicator = Communicator(new_group)      # closes the old one; the optimizer's bucketer follows

Counting: elements are the ``numel`` of the *full* buffer of the collective: the input of a reduce-scatter, the
output of an all-gather, the tensor of an all-reduce or broadcast. So a ZeRO-2 step over Ψ parameters counts Ψ (+ at
most ``world_size - 1`` padding elements per bucket) of ``reduce_scatter`` and as many of ``all_gather``. Every call
carries a ``tag`` saying why it was issued: ``"grad"`` (gradient reduction), ``"param"`` (parameter all-gather),
``"norm"`` (global gradient norm, one scalar), ``"init"`` (one-time broadcast of the initial state), ``"state_dict"``
(:meth:`full_state_dict`), ``"found_inf"`` (the loss scaler's overflow flag), ``"copies"`` (a
:class:`~elasticzero.live.copies.BuddyCopies`'s buddy copies: ops ``send``/``recv`` of
:meth:`Communicator.exchange`, and the commit gate), ``"reshard"`` (an in-memory reshard). A benchmark counting
traffic per step sums the ``grad`` and ``param`` tags between two :meth:`CommStats.snapshot` calls; stats of several
objects add up with ``+``.

The one effect on the process outside the communicators is :func:`unpin_default_group` (torch's own default
arguments), called where a communicator is opened on the default group; see there.

One module per concern: :mod:`.stats` (the counters), :mod:`.work` (the handles of asynchronous collectives),
:mod:`.backends` (decisions read off a backend's name), :mod:`.communicator` (the communicator), :mod:`.patching`
(torch's default arguments). The names below are re-exported here.
"""

from __future__ import annotations

from elasticzero.engine.zero.comm.backends import p2p_batched, ring_applies, settles, wire_for
from elasticzero.engine.zero.comm.communicator import Communicator, OwnsCommunicator, check_replacement
from elasticzero.engine.zero.comm.patching import default_group_pinned, unpin_default_group
from elasticzero.engine.zero.comm.stats import CommStats
from elasticzero.engine.zero.comm.work import AnyWork, LocalWork, PendingWork, WaitedWork, Waiter, same_memory

__all__ = [
    "AnyWork",
    "CommStats",
    "Communicator",
    "LocalWork",
    "OwnsCommunicator",
    "PendingWork",
    "WaitedWork",
    "Waiter",
    "check_replacement",
    "default_group_pinned",
    "p2p_batched",
    "ring_applies",
    "same_memory",
    "settles",
    "unpin_default_group",
    "wire_for",
]
