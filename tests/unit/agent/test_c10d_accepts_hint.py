"""torch's own ``c10d`` rendezvous accepts the config elasticzero-run adds (unknown keys are ignored)."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from elasticzero.agent.options import RDZV_DEFAULTS
from ez_testing import free_port


def test_c10d_handler_built_with_node_rank_hint_and_our_defaults() -> None:
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="hint-check",
        min_nodes=1,
        max_nodes=1,
        node_rank_hint=3,
        **RDZV_DEFAULTS,
    )
    handler = rdzv_registry.get_rendezvous_handler(params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.settings.keep_alive_max_attempt == int(RDZV_DEFAULTS["keep_alive_max_attempt"])
    finally:
        handler.shutdown()
