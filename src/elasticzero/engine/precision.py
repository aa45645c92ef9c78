"""Mixed-precision policy shared by the ZeRO stages, the loss scaler and the config layer.

The master copy of every parameter (and the optimizer state) is always fp32. ``param_dtype`` is the dtype of the
compute copies the model runs with; ``reduce_dtype`` is the dtype gradients are accumulated and reduced in
(fp32 by default, for accuracy; low precision halves the traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elasticzero.errors import UsageError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes for compute (``param_dtype``) and gradient reduction (``reduce_dtype``); masters stay fp32."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16 compute overflows without a loss scaler; bf16 and fp32 do not need one."""
        return self.param_dtype == torch.float16

    @classmethod
    def from_name(cls, name: str, reduce_in_low_precision: bool = False) -> PrecisionPolicy:
        """``"fp32" | "bf16" | "fp16"``; gradients reduce in fp32 unless ``reduce_in_low_precision``."""
        try:
            dtype = _DTYPES[name]
        except KeyError:
            raise UsageError(f"unknown precision {name!r}; use one of: {', '.join(_DTYPES)}") from None
        return cls(param_dtype=dtype, reduce_dtype=dtype if reduce_in_low_precision else torch.float32)


def as_policy(precision: str | PrecisionPolicy) -> PrecisionPolicy:
    """Accept a policy or its name."""
    return precision if isinstance(precision, PrecisionPolicy) else PrecisionPolicy.from_name(precision)
