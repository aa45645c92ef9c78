"""Decisions read off a process group's backend name: whether collectives run as rings, need settling, which device
their messages travel on, whether point-to-point exchanges are posted as one batch. Pure functions of names."""

from __future__ import annotations

import torch


def ring_applies(backend: str, world_size: int, setting: str | None) -> bool:
    """Whether reduce-scatter and all-gather of CPU tensors run as :mod:`.ring` point-to-point rings (2-3x faster
    than gloo's own): on gloo with more than one rank, unless ``setting`` (``ELASTICZERO_GLOO_RING``) is ``"0"``."""
    return setting != "0" and "gloo" in backend.lower() and world_size > 1


def settles(backend: str, device_type: str) -> bool:
    """Whether collectives of tensors on ``device_type`` need :meth:`Communicator.settle`: when gloo serves them
    (``backend`` is one name, or torch's ``"cpu:gloo,cuda:nccl"`` per-device form). gloo's worker threads let go of a
    tensor after completing its work; NCCL's work keeps its tensors in C++ only (stashed until the collective's end
    event, for the caching allocator) and its watchdog is joined by ``destroy_process_group``, so nothing is waited
    for on the host there (docs/engine.md, "On CUDA")."""
    per_device = dict(part.split(":", 1) for part in backend.lower().split(",") if ":" in part)
    return per_device.get(device_type, backend.lower()) == "gloo"


#: backends whose groups send and receive host tensors (torch's per-device form names one per device type instead)
_HOST_BACKENDS = ("gloo", "mpi")


def wire_for(backend: str, device: torch.device) -> torch.device:
    """The device the messages of a group of ``backend`` travel on, for an engine object computing on ``device``: the
    host when the group takes host tensors (gloo, MPI, or a per-device ``"cpu:gloo,cuda:nccl"`` group that names a
    backend for ``cpu``), else ``device`` itself (NCCL sends CUDA tensors only). The one rule for every buffer the
    buddy copies and the in-memory reshard send or receive (docs/engine.md, "On CUDA")."""
    per_device = dict(part.split(":", 1) for part in backend.lower().split(",") if ":" in part)
    takes_host = "cpu" in per_device if per_device else backend.lower() in _HOST_BACKENDS
    return torch.device("cpu") if takes_host or device.type == "cpu" else device


def p2p_batched(backend: str, device_type: str) -> bool:
    """Whether :meth:`Communicator.exchange` posts its sends and receives as one ``batch_isend_irecv`` (one NCCL
    group): wherever gloo does not serve the tensors. Two NCCL ranks that each send to and receive from the other,
    posted one by one on the pair's stream, wait for each other once a message exceeds NCCL's buffer; in one group
    they progress together. gloo keeps one ``isend``/``irecv`` per tensor (each work settled, :meth:`settle`)."""
    return not settles(backend, device_type)
