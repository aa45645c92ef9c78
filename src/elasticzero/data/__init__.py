"""elasticzero.data: a world-size-independent, resumable distributed sampler, its loader (and the builder that makes
it agree with the gradient accumulation), and a byte-level corpus.

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
    "default_cache_dir": "elasticzero.data.corpus",
    "build_loader": "elasticzero.data.build",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
