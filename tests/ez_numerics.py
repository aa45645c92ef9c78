"""The one rule for comparing a training run with a reference computed in the same process, on any CPU.

Two fp32 computations of the same math (a ZeRO run: sharded, bucketed, all-reduced; and plain torch on one process)
differ by rounding only. How far rounding moves a trajectory is not a constant: it depends on the kernels torch
picked for this CPU (``ATEN_CPU_CAPABILITY`` ``default``/``avx2``/``avx512``: vector width, so reduction order), on
the model's size (the length of every sum) and on the steps (Adam divides by ``sqrt(v) + eps``, so a gradient that is
rounding noise becomes a full-size update). A fixed bound tuned on one CPU fails on another.

So the rounding scale is measured in the same run: the same reference math in float64 is the truth (to ~1e-16,
2^29 times finer than fp32), ``rmse(ref, truth)`` is how much fp32 rounding moved the reference on this machine,
and the run under test, made of the same kind of roundings, may be off by at most ``MULT`` times that:

    rmse(got, truth) <= MULT * rmse(ref, truth) + U32 * rms(truth)

``MULT = 3`` is the multiplier torch's own compiler accuracy check uses for small tensors
(``torch._dynamo.utils.same(..., fp64_ref=...)``, ``res_error <= multiplier * ref_error + tol``); the floor
``U32 * rms(truth)`` is the error of merely storing the truth in fp32 (half an ulp per element), so an exact
reference does not make the bound zero. Where the truth itself passed through an fp32 store before it was compared
(a loss the HF ``Trainer`` logs: it sums every run's losses in an fp32 tensor, the float64 run's too), the compared
values are two stores apart, and the floor counts both (``fp32_stores=2``): a few logged scalars can round to the
very values of the truth in the reference and to the neighbouring float in the run under test, so the measured
scale is 0 and one ulp is twice the one-store floor. The rmse is pooled over every tensor compared (a model's whole
state), which keeps it statistically stable; a real bug (a wrong learning rate, a step applied twice, a shard in the
wrong place) is off by ``lr``-sized amounts, orders of magnitude beyond it.

A bf16 run is compared the same way with a reference that rounds where it does (a bf16 copy of fp32 masters for
forward and backward, gradients averaged in fp32): its ``rmse(ref, truth)`` is then bf16's rounding scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

U32 = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff, 2^-24
MULT = 3.0

Values = Mapping[str, torch.Tensor] | Sequence[float] | torch.Tensor


def _flat(values: Values, keys: Sequence[str] | None) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().double().reshape(-1)
    if isinstance(values, Mapping):
        assert keys is not None
        return torch.cat([values[k].detach().double().reshape(-1) for k in keys])
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item() if t.numel() else 0.0


def error_ratio(got: Values, ref: Values, truth: Values, fp32_stores: int = 1) -> float:
    """``rmse(got, truth) / (MULT * rmse(ref, truth) + fp32_stores * U32 * rms(truth))``: at most 1 when ``got`` is as
    close to the float64 ``truth`` as rounding allows, as measured by the reference ``ref`` computed in the same
    precision (state dicts are compared over the keys of ``truth``; sequences and tensors element-wise);
    ``fp32_stores``: 2 where the truth was stored in fp32 before it reached the test (the module's docstring)."""
    keys = sorted(truth) if isinstance(truth, Mapping) else None
    g, r, t = (_flat(v, keys) for v in (got, ref, truth))
    assert g.shape == r.shape == t.shape, (g.shape, r.shape, t.shape)
    allowed, err = MULT * _rms(r - t) + fp32_stores * U32 * _rms(t), _rms(g - t)
    return err / allowed if allowed else (0.0 if err == 0 else float("inf"))
