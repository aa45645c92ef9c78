"""``ZeroOptimizer.release()``: a model and optimizer dropped while the process goes on (a live round change) are
collected once the optimizer's hooks are off — and are not without it: a parameter's post-accumulate-grad hook is held
by autograd's C++ node, an edge Python's collector cannot see (the live loop's ~5x-the-model leak per round)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.zero.flat import FlatBucket, lying_flat, mark_flat, new_flat
from elasticzero.engine.zero.layout import ZeroLayout
from elasticzero.errors import UsageError
from elasticzero.live.reshard import Holdings

STAGES = [ZeroStage1, ZeroStage2, ZeroStage3]
pytestmark = pytest.mark.usefixtures("group")


def trained(stage: Any) -> tuple[weakref.ref[Any], weakref.ref[nn.Module], Any]:
    """A small model and its optimizer after one step; weak references to both, and the optimizer."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = stage(model, torch.optim.AdamW, lr=1e-3)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return weakref.ref(opt), weakref.ref(model), opt


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.__name__)
def test_a_released_optimizer_and_its_model_are_collected(stage: Any) -> None:
    opt_ref, model_ref, opt = trained(stage)
    opt.release()
    del opt
    gc.collect()
    assert opt_ref() is None and model_ref() is None


@pytest.mark.parametrize("stage", [ZeroStage2], ids=lambda s: s.__name__)
def test_without_release_the_parameters_hooks_keep_them_alive(stage: Any) -> None:
    """The reason for ``release``: unreachable from Python, yet never collected (torch holds the hooks in C++)."""
    opt_ref, model_ref, opt = trained(stage)
    del opt
    gc.collect()
    assert opt_ref() is not None and model_ref() is not None
    opt_ref().release()  # type: ignore[union-attr]  # let this test's own go
    gc.collect()
    assert opt_ref() is None and model_ref() is None


# -- unwrap: the module handed back, to be wrapped again (a live survivor keeps its model) -----------------------------
def first_step(stage: Any, model: nn.Module, x: torch.Tensor) -> Any:
    opt = stage(model, torch.optim.AdamW, lr=1e-2)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return opt


def fresh_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage2], ids=lambda s: s.__name__)
def test_an_unwrapped_module_is_wrapped_again_and_trains_as_a_fresh_copy_of_it(stage: Any) -> None:
    """Unwrap after a step, wrap again: the next step equals one taken by a new optimizer on a fresh model holding
    the same values (bitwise: the same ops on the same numbers); the old optimizer's buffers and masters are never
    written again — not by the new wrap, not by the training after it (a live reshard reads them meanwhile)."""
    x = torch.randn(4, 8)
    model = fresh_model()
    old = first_step(stage, model, x)
    masters = [m.detach().clone() for m in old.masters]
    kept = old.unwrap()
    assert kept is model and old.rewrappable()
    assert all(p.grad is None for p in model.parameters())
    copy = fresh_model()
    copy.load_state_dict(model.state_dict())  # the unwrapped module is a plain one: no hook of the old optimizer
    for m in (model, copy):
        first_step(stage, m, x)
    for (name, p), q in zip(model.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert all(torch.equal(m, before) for m, before in zip(old.masters, masters, strict=True))


class WithState(nn.Module):
    """A trainable layer, a frozen one and a buffer training changes (BatchNorm's running mean): the module state a
    ZeRO optimizer's masters do not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.norm, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.frozen(x)))


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage2], ids=lambda s: s.__name__)
def test_the_state_read_before_unwrap_stays_whatever_the_next_wrap_writes(stage: Any) -> None:
    """A live survivor reads its state (masters and the module's frozen parameters and buffers), unwraps, and the next
    wrap broadcasts the module from its group's rank 0 — a joining process's fresh model where that rank is one —
    before the reshard reads the state. Written over here as that broadcast writes (in place), the state read stays
    the old round's: the masters and, since the module's own tensors get storage of their own too, its buffers and
    frozen parameters (before, they were the live tensors: a fresh joiner at rank 0 reset the running mean)."""
    torch.manual_seed(0)
    model = WithState()
    old = first_step(stage, model, torch.randn(4, 8))
    held = old.sharded_state()
    before = {k: v.clone() for k, v in held.module.items()}
    masters = {n: c.tensor.clone() for n, c in held.params.items()}
    assert set(before) >= {"frozen.weight", "norm.running_mean"} and before["norm.running_mean"].abs().sum() > 0
    kept = old.unwrap()
    with torch.no_grad():
        for t in [*kept.parameters(), *kept.buffers()]:
            t.data.fill_(7)  # a broadcast from a rank holding other values
    assert all(torch.equal(held.module[k], v) for k, v in before.items())
    assert all(torch.equal(held.params[n].tensor, v) for n, v in masters.items())


def test_a_module_whose_parameters_are_not_whole_fp32_values_is_not_handed_back() -> None:
    x = torch.randn(4, 8)
    stage3 = first_step(ZeroStage3, fresh_model(), x)
    bf16 = ZeroStage2(fresh_model(), torch.optim.AdamW, lr=1e-2, precision="bf16")
    assert not stage3.rewrappable() and not bf16.rewrappable()
    for opt in (stage3, bf16):
        with pytest.raises(UsageError, match=r"unwrap\(\): .* build a fresh model instead"):
            opt.unwrap()


def storages(model: nn.Module) -> list[int]:
    return [p.untyped_storage().data_ptr() for p in model.parameters()]


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage2], ids=lambda s: s.__name__)
def test_a_module_handed_back_without_a_copy_is_wrapped_again_in_its_own_buffers(stage: Any) -> None:
    """``unwrap(copy=False)``: the next wrap takes over the buffers the parameters lie flat in — the same storage, no
    value changed — and trains exactly as a fresh copy of the module (bitwise). What was read of the old optimizer
    before is the caller's to detach: ``sharded_state().detached()`` keeps the masters and module state read, the
    moments stay the released optimizer's (never written again)."""
    x = torch.randn(4, 8)
    model = fresh_model()
    old = first_step(stage, model, x)
    held = old.sharded_state().detached()
    read = {n: c.tensor.clone() for n, c in held.params.items()}
    before, values = storages(model), [p.detach().clone() for p in model.parameters()]
    kept = old.unwrap(copy=False)
    assert kept is model and storages(model) == before  # nothing copied
    copy = fresh_model()
    copy.load_state_dict(model.state_dict())
    new = first_step(stage, model, x)
    first_step(stage, copy, x)
    assert storages(model) == before and all(new.master_views_params(i) for i in range(len(new.masters)))
    for (name, p), q in zip(model.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, v) for p, v in zip(model.parameters(), values, strict=True))  # it stepped in place
    assert all(torch.equal(held.params[n].tensor, v) for n, v in read.items())  # the detached masters stayed


def test_parameters_that_do_not_lie_as_a_bucket_wants_are_copied_into_a_new_buffer() -> None:
    """A rewrap with smaller buckets (every parameter its own): the old buffer holds other buckets' parameters too,
    so none is taken over — zeroing a bucket's padding there would write its neighbour — and the values are kept."""
    model = fresh_model()
    old = first_step(ZeroStage2, model, torch.randn(4, 8))
    values = [p.detach().clone() for p in model.parameters()]
    before = storages(model)
    ZeroStage2(old.unwrap(copy=False), torch.optim.AdamW, lr=1e-2, bucket_bytes=1)
    assert all(a != b for a, b in zip(storages(model), before, strict=True))
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values, strict=True))


@pytest.mark.parametrize(("world", "kept"), [(2, True), (3, True), (4, True), (5, False)])
def test_a_buffer_made_at_one_rank_is_taken_over_up_to_three_ranks_and_more_where_the_padding_fits(
    world: int, kept: bool
) -> None:
    """A buffer the engine makes has room for its bucket's padding at any world up to 2 * world + 1 (2 * world
    elements more), beyond that where the padding happens to fit: 7 elements made at one rank (room 2: 9) hold the
    layout of 2 (8), 3 (9) and 4 (8) ranks, not of 5 (10)."""
    shapes = [("a", (3,)), ("b", (2, 2))]
    made = new_flat(FlatBucket(ZeroLayout.of([shapes], 1).buckets[0], [], 0), torch.float32, torch.device("cpu"))
    params = [nn.Parameter(made[0:3]), nn.Parameter(made[3:7].view(2, 2))]
    mark_flat(FlatBucket(ZeroLayout.of([shapes], 1).buckets[0], params, 0), made)  # laid in by a wrap at one rank
    bucket = FlatBucket(ZeroLayout.of([shapes], world).buckets[0], params, 0)
    found = lying_flat(bucket, {made.untyped_storage().data_ptr(): 2})
    assert (found is not None) == kept
    if found is not None:
        assert found.numel() == bucket.padded_numel and found.data_ptr() == made.data_ptr()
    assert lying_flat(bucket, {made.untyped_storage().data_ptr(): 3}) is None  # a third tensor views it


def test_holdings_are_detached_from_the_model_where_they_view_it() -> None:
    """``Holdings.detached()`` (a live survivor before its model is handed back without a copy): its own state's
    masters, and every state's module entries — its own and a ward's copy's name the live module's frozen parameters
    and buffers (BuddyCopies: the module's state is the live one's) — are copies, equal, one per tensor; its optimizer
    state and a ward's masters are the same tensors (nothing writes them). Written over afterwards as the next
    wrap's broadcast writes the module, every held value stays."""
    model = WithState()
    opt = first_step(ZeroStage2, model, torch.randn(4, 8))
    own, ward = opt.sharded_state(), opt.sharded_state()  # the ward's masters stand in for a host copy's
    held = Holdings(0, {0: own, 1: ward}, {0: 1, 1: 1})
    before = {k: v.clone() for k, v in own.module.items()}
    out = held.detached()
    mine, theirs = out.states[0], out.states[1]
    assert out.owner == 0 and out.steps == held.steps
    for name, chunk in own.params.items():
        assert torch.equal(mine.params[name].tensor, chunk.tensor)
        assert mine.params[name].tensor.data_ptr() != chunk.tensor.data_ptr()
        assert theirs.params[name].tensor is ward.params[name].tensor
    for key, t in own.module.items():
        assert torch.equal(mine.module[key], t) and mine.module[key].data_ptr() != t.data_ptr()
        assert theirs.module[key] is mine.module[key]  # the same live tensor: copied once
    for name, by_key in own.optim_state.items():
        assert all(mine.optim_state[name][k].tensor.data_ptr() == c.tensor.data_ptr() for k, c in by_key.items())
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data.fill_(7)
    assert all(torch.equal(s.module[k], v) for s in (mine, theirs) for k, v in before.items())
    assert Holdings().detached() == Holdings()


def test_a_first_wrap_never_takes_over_a_users_storage() -> None:
    """Only a buffer an optimizer of this engine laid the parameters in is taken over (``mark_flat``): a model's own
    parameters that happen to fit a bucket — here each its own bucket, its own storage, no padding at one rank — are
    copied as before (a user's alias of them keeps its values), and a parameter viewing part of a larger tensor is
    never one whose padding a wrap would zero (the tensor's next element)."""
    model = fresh_model()
    before = storages(model)
    ZeroStage2(model, torch.optim.AdamW, lr=1e-2, bucket_bytes=1)
    assert all(a != b for a, b in zip(storages(model), before, strict=True))
    big = torch.arange(9.0)
    part = nn.Parameter(big[:7])
    bucket = FlatBucket(ZeroLayout.of([[("w", (7,))]], 2).buckets[0], [part], 0)  # padded to 8 at two ranks
    assert lying_flat(bucket, {big.untyped_storage().data_ptr(): 1}) is None
