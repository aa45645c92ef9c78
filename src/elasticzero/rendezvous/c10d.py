"""The c10d (TCPStore) backend of the ``elasticzero`` rendezvous: torch's own, under the name ``elasticzero``.

The node whose address matches the endpoint host hosts the TCPStore (torch's heuristic; ``is_host=`` overrides it).
"""

from __future__ import annotations

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend

from elasticzero.rendezvous.endpoint import EndpointSpec
from elasticzero.rendezvous.options import RendezvousOptions

BACKEND_NAME = "elasticzero"


class ElasticZeroC10dBackend(C10dRendezvousBackend):
    """torch's :class:`C10dRendezvousBackend`, reporting the backend name ``elasticzero``."""

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME


def create_c10d_backend(
    params: RendezvousParameters, spec: EndpointSpec, options: RendezvousOptions
) -> tuple[ElasticZeroC10dBackend, Store]:
    """Create (or connect to) the TCPStore named by ``spec`` and the backend that keeps the state in it."""
    config: dict[str, object] = {"read_timeout": options.read_timeout}
    if options.is_host is not None:
        config["is_host"] = options.is_host
    torch_params = RendezvousParameters(
        backend="c10d",
        endpoint=spec.c10d_endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **config,
    )
    _, store = create_backend(torch_params)
    return ElasticZeroC10dBackend(store, params.run_id), store
