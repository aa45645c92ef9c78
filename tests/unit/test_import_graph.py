"""The import graph of elasticzero's modules (and the shipped launcher plugins), read from the source, not by importing
it: every ``import`` counts wherever it stands (module level, inside a function, under ``TYPE_CHECKING``), because a
lazy import still makes two modules depend on each other.

- No import circles between modules.
- The dependency direction of docs/architecture.md (config ← engine ← checkpoint) never runs backwards into the
  engine, and between top-level packages no circle passes through the engine or the checkpoint.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "src" / "elasticzero", ROOT / "plugins" / "elasticzero_plugins")
# what the engine may import of elasticzero: itself and the shared pieces (config is below it, nothing else)
ENGINE_MAY_IMPORT = (
    "elasticzero.engine",
    "elasticzero.config",
    *(
        f"elasticzero.{m}" for m in ("errors", "proc", "fileio", "_lazy", "torchcompat", "progress")
    ),  # shared by every piece
)
ACYCLIC_PACKAGES = ("elasticzero.engine", "elasticzero.checkpoint")


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` of :data:`PACKAGES` (a package is its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every dotted name ``path`` imports (``from a import b`` yields ``a`` and ``a.b``; relative ones resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*head, base] if base else head)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the modules of :data:`PACKAGES` it imports (a name resolves to its longest known prefix)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in _imported(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (``[a, b, …, a]``), or ``None`` (iterative depth-first search, grey/black marking)."""
    done: set[str] = set()
    for start in sorted(edges):
        if start in done:
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                done.add(path.pop())
                stack.pop()
            elif nxt in path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _packages(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between top-level packages (``elasticzero.engine``, …): a module's imports are its package's."""
    top = {m: ".".join(m.split(".")[:2]) for m in edges}
    out: dict[str, set[str]] = {p: set() for p in top.values()}
    for m, targets in edges.items():
        out[top[m]] |= {top[t] for t in targets} - {top[m]}
    return out


def test_the_reader_sees_imports_of_every_kind() -> None:
    modules = _modules()
    edges = _edges(modules)
    assert "elasticzero.launch.plan" in edges["elasticzero.launch.backend"]  # module level
    assert "elasticzero.launch.resources" in edges["elasticzero.autotune.cli"]  # inside a function
    assert "elasticzero.launch.backend" in edges["elasticzero_plugins.local"]  # into the plugins' imports
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circles() -> None:
    cycle = _cycle(_edges(_modules()))
    assert cycle is None, "import circle: " + " -> ".join(cycle or []) + "; move the shared piece down a layer"


def test_the_engine_imports_nothing_above_it() -> None:
    edges = _edges(_modules())
    upward = {m: sorted(t for t in ts if not _in(t, ENGINE_MAY_IMPORT)) for m, ts in edges.items()}
    assert {m: ups for m, ups in upward.items() if ups and _in(m, ("elasticzero.engine",))} == {}


def test_no_package_circle_through_the_engine_or_the_checkpoint() -> None:
    packages = _packages(_edges(_modules()))
    through = {p: ts for p, ts in packages.items() if _in(p, ACYCLIC_PACKAGES)}
    # a circle through one of them has every edge inside the subgraph reachable from it; test each start alone
    for start in through:
        reach, todo = {start}, [start]
        while todo:
            for t in packages[todo.pop()]:
                if t not in reach:
                    reach.add(t)
                    todo.append(t)
        sub = {p: packages[p] & reach for p in reach}
        cycle = _cycle(sub)
        assert cycle is None or start not in cycle, "package circle: " + " -> ".join(cycle)
