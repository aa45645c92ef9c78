"""elasticzero.data: a world-size-independent, resumable distributed sampler, its loader, and a byte-level corpus.

Names resolve lazily (PEP 562): importing the package loads no torch.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "ElasticSampler": "elasticzero.data.sampler",
    "epoch_order": "elasticzero.data.sampler",
    "ElasticLoader": "elasticzero.data.loader",
    "ByteCorpus": "elasticzero.data.corpus",
    "stdlib_corpus": "elasticzero.data.corpus",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
