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
