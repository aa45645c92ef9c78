"""Held-memory accounting: real tensor storage, each storage counted once (views share it)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def storage_report(categories: Iterable[tuple[str, Iterable[torch.Tensor | None]]]) -> dict[str, int]:
    """Bytes of distinct storages per category; a storage seen in an earlier category is not counted again."""
    seen: set[int] = set()
    report: dict[str, int] = {}
    for name, tensors in categories:
        total = 0
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        report[name] = report.get(name, 0) + total
    return report


#: the categories of :func:`model_state_report` that are model state (``frozen`` and ``scratch`` are not)
MODEL_STATE = ("params", "master", "grads", "optim_state")


def model_state_report(categories: Iterable[tuple[str, Iterable[torch.Tensor | None]]], numel: int) -> dict[str, float]:
    """:func:`storage_report` of ``categories`` plus ``total`` (the :data:`MODEL_STATE` categories), ``numel`` (Ψ,
    trainable elements) and ``bytes_per_param`` (``total / numel``)."""
    rep: dict[str, float] = dict(storage_report(categories))
    rep["total"] = sum(rep[k] for k in MODEL_STATE)
    rep["numel"] = numel
    rep["bytes_per_param"] = rep["total"] / numel
    return rep
