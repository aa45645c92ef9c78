"""What cannot sit a step out (``ZeroOptimizer.sit_out``; the step itself on real ranks:
tests/integration/engine/test_sit_out.py): stage 3, whose forward gathers from every rank, and a one-rank group; and
``contributing``'s bounds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.errors import UsageError


@pytest.mark.usefixtures("group")
def test_stage3_and_a_one_rank_group_refuse_to_sit_out() -> None:
    opt3 = ZeroStage3(nn.Linear(4, 4), torch.optim.AdamW)
    for call in (opt3.sit_out, lambda: opt3.contributing(1)):
        with pytest.raises(UsageError, match="stage 3's forward gathers"):
            call()
    opt2 = ZeroStage2(nn.Linear(4, 4), torch.optim.AdamW)
    with pytest.raises(UsageError, match="one-rank group has no other rank"):
        opt2.sit_out()
    with pytest.raises(UsageError, match=r"contributing\(2\): between 1 and the group's 1 ranks"):
        opt2.contributing(2).__enter__()
    with opt2.contributing(1):
        assert opt2.bucketer.contributors == 1
    assert ZeroStage1.sit_out_refused is None and ZeroStage2.sit_out_refused is None
