"""The engine keeps no process-wide mutable state: every counter, cache and list belongs to an object (a process
rebuilding its groups replaces objects, and nothing left over in a module can leak into the new ones)."""

from __future__ import annotations

import ast
from pathlib import Path

import elasticzero.engine

ENGINE = Path(elasticzero.engine.__file__).parent
# module-level calls that build something that never changes; any other call (a container, an instance of a class
# with counters, a cache) is taken for state
IMMUTABLE_FACTORIES = {"nullcontext", "lazy_getattr", "getattr", "frozenset", "tuple", "TypeVar", "MappingProxyType"}
# module-level containers that are constant tables, never changed after import
CONSTANT_TABLES = {
    ("precision.py", "_DTYPES"): "name -> dtype table read by PrecisionPolicy.from_name",
    ("__init__.py", "_LAZY"): "lazy export table read by lazy_getattr",
    ("zero/__init__.py", "_LAZY"): "lazy export table read by lazy_getattr",
}


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name not in IMMUTABLE_FACTORIES
    return False


def _module_state(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = path.relative_to(ENGINE).as_posix()
    found = []
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        for t in targets:
            name = getattr(t, "id", "")
            if value is not None and _is_mutable(value) and name != "__all__" and (rel, name) not in CONSTANT_TABLES:
                found.append(f"{rel}:{node.lineno} {name}")
    found += [f"{rel}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_no_module_level_mutable_state_in_the_engine() -> None:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 10  # the scan sees the engine package
    found = [hit for path in files for hit in _module_state(path)]
    assert not found, f"module-level mutable state in engine/ (move it into the object that owns it): {found}"
