"""Hugging Face ``transformers`` models under the ZeRO stages: export and lock-step generation.

Nothing here imports ``transformers``: the functions work on any ``PreTrainedModel`` passed in.

- :func:`save_pretrained` is the one correct way to export a model trained under any stage and precision: the fp32
  masters (:meth:`~elasticzero.engine.zero.base.ZeroOptimizer.full_state_dict`), with ``config.json`` saying
  ``float32`` (``model.save_pretrained()`` alone writes the bf16/fp16 compute copies on stages 1/2, refuses on stage 3,
  and with ``state_dict=opt.full_state_dict()`` still records the compute dtype, which ``from_pretrained`` then loads
  in).
- :func:`mark_sharded` (called by ``ZeroStage3``): ranks must run the same number of forwards when parameters are
  sharded, so ``generate()`` has to keep finished ranks stepping until all are done (``synced_gpus=True``). HF turns
  that on by itself for DeepSpeed ZeRO-3 and for modules carrying FSDP2's ``_is_fsdp_managed_module`` flag; the
  flag on the root makes ``model.generate(...)`` work out of the box on stage 3.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch import nn

from elasticzero.errors import UsageError

SHARDED_FLAG = "_is_fsdp_managed_module"
"""The attribute HF's ``is_fsdp_managed_module`` reads (set by torch's ``fully_shard`` on the modules it manages)."""
ORIG_PARAMS_FLAG = "_fsdp_use_orig_params"
"""Set beside :data:`SHARDED_FLAG` by ``fully_shard``: ``torch.compile`` refuses a module carrying the first without
this one (FSDP1's flat parameters) and falls back to eager for the whole frame; with both, it traces the module's
parameters as the graph's inputs, as it does for FSDP2."""


def mark_sharded(module: nn.Module) -> None:
    """Tell libraries that look for FSDP2's flag (HF ``generate()``: ``synced_gpus``) that ``module``'s parameters
    are sharded over ranks, so every rank must run every forward; and ``torch.compile`` that its parameters are
    the module's own tensors (both flags, as ``fully_shard`` sets them)."""
    setattr(module, SHARDED_FLAG, True)
    setattr(module, ORIG_PARAMS_FLAG, True)


def save_pretrained(model: Any, opt: Any, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
    """Export ``model`` (a ``transformers.PreTrainedModel`` trained under the ZeRO optimizer ``opt``, any stage or
    precision) with its fp32 master weights; ``Model.from_pretrained(save_directory)`` loads them back in fp32.

    Collective: every rank of ``opt.process_group`` must call it (the weights are all-gathered); only global rank 0
    writes unless ``is_main_process=`` says otherwise. ``kwargs`` go to ``model.save_pretrained`` (not
    ``state_dict``).
    """
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise UsageError(f"save_pretrained needs a transformers PreTrainedModel, got {type(model).__name__}")
    if "state_dict" in kwargs:
        raise UsageError("save_pretrained writes opt.full_state_dict(); do not pass state_dict=")
    state_dict = opt.full_state_dict()
    main = kwargs.pop("is_main_process", dist.get_rank() == 0)
    model.save_pretrained(save_directory, state_dict=state_dict, is_main_process=main, **kwargs)
    if main:
        # save_pretrained recorded the dtype of the module's (compute) parameters; the weights written are fp32
        model.config.dtype = "float32"
        model.config.save_pretrained(save_directory)
