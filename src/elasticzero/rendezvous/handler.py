"""The ``elasticzero`` rendezvous handler: torch's :class:`DynamicRendezvousHandler` plus node-rank hints.

torch's join, heartbeat, last-call and close logic run unchanged; only the store behind it (c10d TCPStore or etcd
v3) and the final order of the group ranks are ours.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
)

from elasticzero.rendezvous.endpoint import parse_endpoint
from elasticzero.rendezvous.options import RendezvousOptions, parse_options
from elasticzero.rendezvous.ordering import publish_hint, ranks_by_hint

logger = logging.getLogger(__name__)


class ElasticZeroRendezvousHandler(DynamicRendezvousHandler):
    """A :class:`DynamicRendezvousHandler` whose group ranks follow ``node_rank_hint`` and that frees its backend.

    Built by :meth:`create` (torch's ``from_backend`` with elasticzero's part added): the node-rank hint and the
    backend's release hook are constructor arguments, fixed for the handler's life.

    The rank is re-assigned inside ``_get_world`` (called once per ``next_rendezvous``, before torch builds the
    bootstrap store info), so the node that ends up as group rank 0 is also the one that hosts the workers' store and
    publishes ``MASTER_ADDR``/``MASTER_PORT``: every node sees the same master address. From the second round on,
    the bootstrap info is rebuilt every round (torch would keep a stale master on the nodes that are not rank 0).
    The hints travel in the run's store (the one given to the constructor), each written by its node before it joins
    (:mod:`~elasticzero.rendezvous.ordering`). Our own attributes are name-mangled (``self.__x``), so they can never
    collide with torch's.
    """

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        backend_name: str,
        store: Store,
        state_holder: _BackendRendezvousStateHolder,
        *,
        node_rank_hint: int | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(node, settings, backend_name, store, state_holder)
        self.__hint = node_rank_hint
        self.__run_store = store  # the run's store (not a round's): where hints are published
        self.__release = release
        #: the last round this node re-ranked (its number and participants) and the (rank, world size) it got
        self.__world: tuple[tuple[int, frozenset[Any]], tuple[int, int]] | None = None
        self.__completed = False  # the current next_rendezvous got past torch's join: a round completed with it

    @classmethod
    def create(
        cls,
        params: RendezvousParameters,
        options: RendezvousOptions,
        backend: RendezvousBackend,
        store: Store,
        release: Callable[[], None] | None = None,
    ) -> ElasticZeroRendezvousHandler:
        """torch's ``from_backend`` (same node descriptor, settings and state holder), with our part passed in."""
        settings = RendezvousSettings(
            params.run_id,
            params.min_nodes,
            params.max_nodes,
            RendezvousTimeout(
                _timeout(options.join_timeout),
                _timeout(options.last_call_timeout),
                _timeout(options.close_timeout),
                _timeout(options.heartbeat_timeout),
            ),
            keep_alive_interval=timedelta(seconds=options.keep_alive_interval),
            keep_alive_max_attempt=options.keep_alive_max_attempt,
        )
        node = cls._node_desc_generator.generate(params.local_addr)
        holder = _BackendRendezvousStateHolder(backend, settings)
        return cls(node, settings, backend.name, store, holder, node_rank_hint=options.node_rank_hint, release=release)

    @property
    def node_rank_hint(self) -> int | None:
        """The hint this node publishes (``None``: it has none and sorts after the hinted nodes)."""
        return self.__hint

    def next_rendezvous(self) -> RendezvousInfo:
        """torch's, with this node's hint published first; joined once more if the completed round's rank 0 was lost
        before it published the workers' master address (torch's wait for it then times out: ``read_timeout``)."""
        try:
            return self._join()
        except DistStoreError as exc:
            if not self.__completed:
                raise
            logger.warning(
                "elasticzero: a round completed but its rank 0 never published the master address (%s); "
                "joining the next round without it",
                exc,
            )
            return self._join()

    def _join(self) -> RendezvousInfo:
        self.__completed = False
        # before the join: a round completes only with the hints of all its nodes in the store
        publish_hint(self.__run_store, self.get_run_id(), self._this_node, self.__hint)
        return super().next_rendezvous()

    def _get_world(self) -> tuple[int, int]:
        rank, world_size = super()._get_world()
        self.__completed = True
        state = self._state_holder.state
        # A round is identified by its number *and* its participants: a run wiped and started again also has a
        # round 0, with other nodes (or other pids) in it.
        round_ = (state.round, frozenset(state.participants.items()))
        if self.__world is not None and self.__world[0] == round_:
            return self.__world[1]
        # hints published before the join: reading them never waits on a node
        new_rank = ranks_by_hint(self.__run_store, self.get_run_id(), dict(state.participants))[self._this_node]
        if new_rank != rank:
            logger.info("elasticzero: node_rank_hint=%s moves group rank %d to %d", self.__hint, rank, new_rank)
        if self.__world is not None:
            # torch caches the workers' bootstrap address after the first round and rebuilds it only on a node that
            # becomes rank 0: the other nodes would keep pointing at a master that may be gone (scale-down). Drop
            # the cache every new round, so rank 0 publishes a fresh store address and everyone reads it.
            self._bootstrap_store_info = None
        self.__world = (round_, (new_rank, world_size))
        return new_rank, world_size

    def release_backend(self) -> None:
        """Release the backend (etcd lease, connections) once, without closing the rendezvous — as a node that dies
        leaves it (tests); :meth:`shutdown` calls it after closing."""
        release, self.__release = self.__release, None
        if release is not None:
            release()

    def shutdown(self) -> bool:
        """Close the rendezvous (torch), then release the backend (etcd lease, connections)."""
        try:
            return super().shutdown()
        finally:
            self.release_backend()


def _timeout(seconds: int | None) -> timedelta | None:
    return None if seconds is None else timedelta(seconds=seconds)


def create_rdzv_handler(params: RendezvousParameters) -> ElasticZeroRendezvousHandler:
    """Creator registered as ``elasticzero``: endpoint → store, ``--rdzv-conf`` → options, then the handler.

    Everything the handler needs comes from ``params`` (plain ``torchrun --rdzv-backend=elasticzero`` calls this with
    nothing else): ``node_rank_hint`` is a ``--rdzv-conf`` key like the others, and reaches the handler's constructor.

    Raises :class:`~elasticzero.errors.UsageError` for a bad endpoint or option and torch's
    ``RendezvousConnectionError`` when the store cannot be reached.
    """
    spec = parse_endpoint(params.endpoint)
    options = parse_options(params.config)
    if spec.kind == "c10d":
        from elasticzero.rendezvous.c10d import create_c10d_backend

        backend, store = create_c10d_backend(params, spec, options)
        return ElasticZeroRendezvousHandler.create(params, options, backend, store)
    from elasticzero.rendezvous.etcd_backend import create_etcd_backend

    etcd = create_etcd_backend(params, spec, options)
    return ElasticZeroRendezvousHandler.create(params, options, etcd.backend, etcd.store, etcd.release)
