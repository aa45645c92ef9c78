"""Mixed-precision policy shared by the ZeRO stages, the loss scaler and the config layer.

The master copy of every parameter (and the optimizer state) is always fp32. ``param_dtype`` is the dtype of the
compute copies the model runs with; ``reduce_dtype`` is the dtype gradients are accumulated and reduced in
(fp32 by default, for accuracy; low precision halves the traffic).

Norm layers with running statistics stay fp32 under a low-precision policy (``fp32_modules``, like FSDP's mixed
precision keeps ``_BatchNorm`` in fp32): their parameters' compute copies are fp32, floating-point inputs are cast up
to fp32 and floating-point outputs back down to ``param_dtype``. BatchNorm needs it (its fp32 running statistics and
a low-precision weight cannot meet in one kernel); add ``nn.LayerNorm``/``nn.GroupNorm`` for accuracy, or pass
``fp32_modules=()`` to run everything in ``param_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from elasticzero.errors import UsageError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

NORM_WITH_STATS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
"""The default ``fp32_modules``: BatchNorm (lazy variants become these once materialised)."""


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes for compute (``param_dtype``) and gradient reduction (``reduce_dtype``); masters stay fp32.

    ``fp32_modules``: module classes whose parameters compute in fp32 under a low-precision ``param_dtype`` (inputs
    cast up, outputs cast down at their boundary); default BatchNorm.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    fp32_modules: tuple[type[nn.Module], ...] = NORM_WITH_STATS

    def keeps_fp32(self, module: nn.Module) -> bool:
        """Whether ``module``'s own parameters compute in fp32 (always true under an fp32 policy)."""
        return self.param_dtype == torch.float32 or isinstance(module, self.fp32_modules)

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16 compute overflows without a loss scaler; bf16 and fp32 do not need one."""
        return self.param_dtype == torch.float16

    @classmethod
    def from_name(cls, name: str, reduce_in_low_precision: bool = False) -> PrecisionPolicy:
        """``"fp32" | "bf16" | "fp16"``; gradients reduce in fp32 unless ``reduce_in_low_precision``; BatchNorm fp32."""
        try:
            dtype = _DTYPES[name]
        except KeyError:
            raise UsageError(f"unknown precision {name!r}; use one of: {', '.join(_DTYPES)}") from None
        return cls(param_dtype=dtype, reduce_dtype=dtype if reduce_in_low_precision else torch.float32)


def as_policy(precision: str | PrecisionPolicy) -> PrecisionPolicy:
    """Accept a policy or its name."""
    return precision if isinstance(precision, PrecisionPolicy) else PrecisionPolicy.from_name(precision)
