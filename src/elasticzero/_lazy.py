"""One rule for the packages' lazy exports (PEP 562): a package lists ``{public name: defining module}`` and gets a
module ``__getattr__`` that imports the defining module on first use, so importing the package imports no torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: names in ``table`` resolve from their module; others raise as Python does."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
