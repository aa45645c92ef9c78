"""Entry point ``torchrun.handlers: elasticzero``: torch calls :func:`handler_creator` with no arguments."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Return the creator torch registers for ``--rdzv-backend=elasticzero``."""
    from elasticzero.rendezvous.handler import create_rdzv_handler

    return create_rdzv_handler
