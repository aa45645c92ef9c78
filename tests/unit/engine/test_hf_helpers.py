"""elasticzero.engine.hf without transformers: the sharded flag HF reads, and save_pretrained's refusals (the export
itself is tested on real models in tests/integration/hf)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage2, ZeroStage3
from elasticzero.engine import hf
from elasticzero.errors import UsageError

pytestmark = pytest.mark.timeout(60)


def test_stage3_flags_the_root_sharded_stage2_does_not(group: None) -> None:
    # transformers' is_fsdp_managed_module(model) reads this attribute to turn synced_gpus on in generate()
    m3, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    ZeroStage3(m3, torch.optim.SGD, lr=0.1)
    ZeroStage2(m2, torch.optim.SGD, lr=0.1)
    assert getattr(m3, hf.SHARDED_FLAG) is True
    assert not hasattr(m2, hf.SHARDED_FLAG)


def test_save_pretrained_refusals(group: None, tmp_path: object) -> None:
    m = nn.Linear(2, 2)
    opt = ZeroStage2(m, torch.optim.SGD, lr=0.1)
    with pytest.raises(UsageError, match="needs a transformers PreTrainedModel, got Linear"):
        hf.save_pretrained(m, opt, str(tmp_path))
    m.save_pretrained = lambda *a, **k: None  # type: ignore[assignment]
    m.config = object()  # type: ignore[assignment]
    with pytest.raises(UsageError, match="do not pass state_dict="):
        hf.save_pretrained(m, opt, str(tmp_path), state_dict={})
