"""The ``torchrun.handlers`` entry point as torch loads it, and the handler it creates (c10d, in process)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.registry import _register_out_of_tree_handlers

from elasticzero.errors import UsageError
from elasticzero.rendezvous.handler import create_rdzv_handler
from ez_testing import free_port

pytestmark = pytest.mark.timeout(60)


def _params(endpoint: str, **conf: object) -> RendezvousParameters:
    return RendezvousParameters("elasticzero", endpoint, "unit", 1, 1, local_addr="127.0.0.1", **conf)


def test_torch_registers_elasticzero_from_the_entry_point() -> None:
    _register_out_of_tree_handlers()
    endpoint = f"127.0.0.1:{free_port()}"
    handler = rendezvous_handler_registry.create_handler(_params(endpoint, timeout=900, join_timeout=20))
    assert handler.get_backend() == "elasticzero"
    assert handler.settings.timeout.join.total_seconds() == 20  # type: ignore[attr-defined]
    assert handler.shutdown()


def test_single_node_rendezvous_and_timeout_alias() -> None:
    handler = create_rdzv_handler(_params(f"tcp://127.0.0.1:{free_port()}", timeout="33", keep_alive_interval="2"))
    assert handler.settings.timeout.join.total_seconds() == 33
    assert handler.settings.keep_alive_interval.total_seconds() == 2
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert handler.shutdown()
    assert handler.is_closed()


def test_bad_conf_is_a_usage_error_before_any_store_is_created() -> None:
    with pytest.raises(UsageError, match="unknown --rdzv-conf"):
        create_rdzv_handler(_params("127.0.0.1:1", bogus="1"))


def test_the_hint_is_given_to_the_constructor_and_published_before_the_join() -> None:
    """``create`` is torch's ``from_backend`` plus our part: same settings, the hint fixed at construction."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from elasticzero.rendezvous.c10d import create_c10d_backend
    from elasticzero.rendezvous.endpoint import parse_endpoint
    from elasticzero.rendezvous.handler import ElasticZeroRendezvousHandler
    from elasticzero.rendezvous.options import parse_options
    from elasticzero.rendezvous.ordering import hint_key

    params = _params(f"127.0.0.1:{free_port()}", node_rank_hint="3", join_timeout="20", keep_alive_max_attempt="5")
    handler = create_rdzv_handler(params)  # what torch's registry calls: RendezvousParameters only
    assert isinstance(handler, ElasticZeroRendezvousHandler) and handler.node_rank_hint == 3
    options = parse_options(params.config)
    backend, store = create_c10d_backend(params, parse_endpoint(params.endpoint), options)
    plain = DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        handler.settings.timeout,
        keep_alive_interval=options.keep_alive_interval,
        keep_alive_max_attempt=options.keep_alive_max_attempt,
    )
    assert vars(handler.settings) == vars(plain.settings)  # RendezvousSettings compares by identity
    assert handler.settings.timeout.join.total_seconds() == 20
    assert handler.get_backend() == plain.get_backend() == "elasticzero"
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert store.get(hint_key("unit", handler._this_node)) == b"3"
    assert handler.shutdown()
