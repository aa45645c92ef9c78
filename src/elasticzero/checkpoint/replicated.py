"""A replicated model and its plain optimizer (DDP, ZeRO stage 0) as one ``Stateful``, through torch's public DCP
state-dict helpers (``torch.distributed.checkpoint.state_dict``): saved at N ranks, it loads at any M."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ReplicatedState"]


class ReplicatedState:
    """``Stateful`` model + optimizer for :class:`~elasticzero.checkpoint.Checkpointer` (the ZeRO stages' counterpart
    is :class:`~elasticzero.engine.zero.dcp_state.ZeroCheckpointState`). ``model`` may be wrapped in DDP or not: the
    keys are the unwrapped module's, and the optimizer state is flattened (one DCP item per parameter and key)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.options,
        )
