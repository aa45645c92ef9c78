"""elasticzero.data: a world-size-independent, resumable distributed sampler, its loader, and a byte-level corpus.

Names resolve lazily (PEP 562): importing the package loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ElasticSampler": "elasticzero.data.sampler",
    "epoch_order": "elasticzero.data.sampler",
    "ElasticLoader": "elasticzero.data.loader",
    "ByteCorpus": "elasticzero.data.corpus",
    "stdlib_corpus": "elasticzero.data.corpus",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elasticzero.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
