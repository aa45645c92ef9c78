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
