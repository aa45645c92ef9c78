"""The engine's hold on the module's parameters: every managed ``nn.Parameter`` is registered in its module and views
the engine's flat buffer. What would break that hold is followed or refused, never left to train silently wrong.

* ``module.to(device|dtype)``, ``.half()``, ``.float()``, ``.cpu()``, a framework's device move: each runs
  ``nn.Module._apply(fn)``, which converts every parameter and rebinds it (``param.data = fn(param)``) — a new storage
  whenever ``fn`` copies, which the same device spelled another way already does (``cpu:0`` for a ``cpu`` tensor,
  the HF ``Trainer``'s and accelerate's move): the engine would step masters the module no longer views. On stage 3
  ``fn`` would even read the freed storage the parameters view (SIGSEGV). :func:`guard_conversions` gives every
  module above a managed parameter its own ``_apply`` (FSDP2's route: ``FSDPModule._apply``): ``fn`` is probed on a
  one-element tensor per (device, dtype) of the managed parameters first. Where it keeps both, the conversion is
  *followed*: the managed parameters are hidden from torch's ``_apply`` (``None`` in their modules' ``_parameters``
  while it runs) and stay the engine's views; frozen parameters and buffers convert as torch converts them. Where it
  changes either, it is *refused* before anything changes, with one line naming the call and the fix (choose the
  precision at construction; move the model before wrapping it).
* ``param.data = x``, ``module.weight = nn.Parameter(x)``: no hook sees these. :meth:`ParamBindings.check` compares
  every binding (registered object, storage) before each forward of the root module and each ``step()``; a stale one
  is put back (the parameter views the engine's storage again, its values the engine's) and the call raises one line.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elasticzero.engine.zero.flat import FlatBucket
from elasticzero.engine.zero.standin import GradStandIns
from elasticzero.errors import UsageError


@dataclass(frozen=True)
class Binding:
    """One managed parameter where the module holds it: ``module._parameters[key] is param``, and ``param`` views
    ``flat[offset : offset + param.numel()]``. A tied parameter has one binding per module registering it."""

    name: str
    module: nn.Module
    key: str
    param: nn.Parameter
    flat: torch.Tensor
    offset: int

    def intact(self) -> bool:
        """The module still registers ``param`` and ``param`` still lives in the engine's storage."""
        registered = self.module._parameters.get(self.key) is self.param
        return registered and self.param.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()

    def restore(self) -> None:
        """Register ``param`` again and make it the engine's view again (its values are the engine's)."""
        self.module._parameters[self.key] = self.param
        storage = self.flat.untyped_storage()
        held = storage.nbytes()  # stage 3 between uses: 0 (torch checks a view's bounds when it is made)
        storage.resize_(max(held, self.flat.numel() * self.flat.element_size()))
        self.param.data = self.flat[self.offset : self.offset + self.param.numel()].view(self.param.shape)
        storage.resize_(held)


@dataclass(frozen=True)
class ParamBindings:
    """Every :class:`Binding` of a ZeRO optimizer's module, and the optimizer's name (``owner``) for its messages."""

    bindings: tuple[Binding, ...]
    owner: str

    @classmethod
    def of(
        cls, module: nn.Module, buckets: Sequence[FlatBucket], flats: Sequence[torch.Tensor], owner: str
    ) -> ParamBindings:
        """The bindings of ``module`` once its managed parameters view ``flats`` (one buffer per bucket)."""
        where = {id(p): (flats[b.index], off) for b in buckets for p, off in zip(b.params, b.offsets, strict=True)}
        found = [
            Binding(f"{mn}.{key}" if mn else key, m, key, p, *where[id(p)])
            for mn, m in module.named_modules(remove_duplicate=False)
            for key, p in m._parameters.items()
            if p is not None and id(p) in where
        ]
        return cls(tuple({(id(b.module), b.key): b for b in found}.values()), owner)

    def within(self, module: nn.Module) -> list[Binding]:
        """The bindings of ``module`` and its submodules."""
        inside = {id(m) for m in module.modules()}
        return [b for b in self.bindings if id(b.module) in inside]

    def check(self, call: str) -> None:
        """Before ``call`` (a forward, a step): every binding intact, else restore the stale ones and raise."""
        stale = [b for b in self.bindings if not b.intact()]
        if not stale:
            return
        for b in stale:
            b.restore()
        raise UsageError(stale_message(self.owner, call, [b.name for b in stale]))


def hold_params(
    module: nn.Module, buckets: Sequence[FlatBucket], flats: Sequence[torch.Tensor], owner: str
) -> tuple[ParamBindings, GradStandIns]:
    """Once ``module``'s managed parameters view ``flats``: their bindings, conversions of ``module`` guarded
    (:func:`guard_conversions`), DDP refused (:func:`refuse_ddp`), and their gradient stand-ins (``standin.py``)."""
    bindings = ParamBindings.of(module, buckets, flats, owner)
    guard_conversions(module, bindings)
    refuse_ddp(module, bindings)
    named = [(n, p) for b in buckets for n, p in zip(b.names, b.params, strict=True)]
    return bindings, GradStandIns(named, owner)


def stale_message(owner: str, call: str, names: Sequence[str]) -> str:
    """The one line for parameters rebound behind the engine's back (``param.data = ...``, a new ``nn.Parameter``)."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{owner}: {call} found {shown} rebound after wrapping (param.data = ... or module.<name> = "
        "nn.Parameter(...)): the engine trains its own storage, so the assignment was undone and the parameters "
        "hold the engine's values; set values with opt.load_full_state_dict(state_dict) (all ranks), or assign "
        "before wrapping"
    )


# -- module._apply: conversions followed or refused -------------------------------------------------------------------
class _Inner:
    """``fn`` as handed on by a guarded ``_apply`` to its children: already checked, managed parameters hidden."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.fn(t)


def conversion_change(fn: Callable[[torch.Tensor], Any], params: Sequence[torch.Tensor]) -> Change | None:
    """What ``fn`` would do to ``params`` beyond a same-device, same-dtype copy, or None. ``fn`` sees one-element
    probes only, never the parameters (stage 3's parameters view freed storage)."""
    kinds = {(p.device, p.dtype) for p in params}
    for device, dtype in sorted(kinds, key=str):
        with torch.no_grad():
            out = fn(torch.zeros(1, device=device, dtype=dtype))
        if out.device != device:
            return Change("move", str(device), str(out.device))
        if out.dtype != dtype:
            return Change("convert", str(dtype), str(out.dtype))
    return None


@dataclass(frozen=True)
class Change:
    """A conversion's effect on the managed parameters: ``move`` (device) or ``convert`` (dtype), from, to."""

    verb: str
    before: str
    after: str


def call_name(module: nn.Module, fn: Callable[..., Any]) -> str:
    """``LlamaForCausalLM.half()``: torch's ``nn.Module`` method that built ``fn`` (``Module.half.<locals>.<lambda>``),
    on ``module``'s class; ``_apply()`` for a function of the caller's own."""
    outer = getattr(fn, "__qualname__", "").split(".<locals>")[0]
    method = outer.removeprefix("Module.") if outer.startswith("Module.") else "_apply"
    return f"{type(module).__name__}.{method}()"


def refusal(owner: str, call: str, change: Change) -> str:
    """The one line for a conversion that would move or cast the managed parameters."""
    fix = (
        "move the model before wrapping it"
        if change.verb == "move"
        else "choose the compute precision at construction (precision='bf16' or 'fp16': fp32 masters, compute "
        "copies cast), or convert the model before wrapping it"
    )
    return (
        f"{owner}: {call} would {change.verb} the parameters {owner} manages from {change.before} to "
        f"{change.after}, but their storage, masters and optimizer state are the engine's: {fix}"
    )


@contextmanager
def hidden(bindings: Sequence[Binding]) -> Iterator[None]:
    """``None`` in place of each bound parameter in its module's ``_parameters`` (torch's ``_apply`` skips those;
    the keys keep their order); put back on exit, an exception included."""
    for b in bindings:
        b.module._parameters[b.key] = None
    try:
        yield
    finally:
        for b in bindings:
            b.module._parameters[b.key] = b.param


def refuse_ddp(module: nn.Module, bindings: ParamBindings) -> None:
    """``DistributedDataParallel(module)`` (accelerate and the HF ``Trainer`` wrap any model at world > 1) would
    broadcast the managed parameters — stage 3's read freed storage: SIGSEGV — and reduce gradients the engine
    reduces. Every managed parameter's name joins ``module._ddp_params_and_buffers_to_ignore`` (torch's list of
    what DDP leaves alone), so DDP finds no trainable parameter and raises at once, before it touches any."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    module._ddp_params_and_buffers_to_ignore = sorted(ignored | {b.name for b in bindings.bindings})  # type: ignore[assignment]


def guard_conversions(module: nn.Module, bindings: ParamBindings) -> None:
    """Give ``module`` and every submodule holding a managed parameter below it a guarded ``_apply`` (an instance
    attribute over the class's, which it calls): the conversion is checked once, at the outermost module called."""
    holders = {id(b.module) for b in bindings.bindings}
    for m in module.modules():
        if any(id(sub) in holders for sub in m.modules()):
            m._apply = types.MethodType(guarded_apply(bindings), m)  # type: ignore[method-assign]


def guarded_apply(bindings: ParamBindings) -> Callable[..., nn.Module]:
    """The guarded ``_apply`` for modules of ``bindings``' module (see :func:`guard_conversions`)."""

    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> nn.Module:
        if isinstance(fn, _Inner):  # a child of a guarded module: checked there, parameters already hidden
            return type(self)._apply(self, fn, recurse)
        mine = bindings.within(self) if recurse else [b for b in bindings.bindings if b.module is self]
        change = conversion_change(fn, [b.param for b in mine])
        if change is not None:
            raise UsageError(refusal(bindings.owner, call_name(self, fn), change))
        with hidden(mine):
            return type(self)._apply(self, _Inner(fn), recurse)

    return _apply
