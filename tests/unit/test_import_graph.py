"""The import graph of src/elasticzero, read from the source (every import, also inside functions): the dependency
direction of docs/architecture.md (config ← engine ← checkpoint) never runs backwards into the engine, and the engine
and checkpoint modules sit on no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ACYCLIC = ("elasticzero.engine", "elasticzero.checkpoint")
# what the engine may import of elasticzero: itself and the shared pieces (config is below it, nothing else)
ENGINE_MAY_IMPORT = (
    "elasticzero.engine",
    "elasticzero.config",
    *(f"elasticzero.{m}" for m in ("errors", "proc", "fileio", "_lazy")),  # shared by every piece
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "elasticzero").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The elasticzero modules ``module`` imports (``from pkg import name`` counts as ``pkg.name`` when that is one)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in found if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path of imports from ``start`` back to itself, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_the_engine_imports_nothing_above_it() -> None:
    graph = _graph()
    upward = {m: sorted(i for i in imps if not _in(i, ENGINE_MAY_IMPORT)) for m, imps in graph.items()}
    assert {m: ups for m, ups in upward.items() if ups and _in(m, ("elasticzero.engine",))} == {}


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the top-level packages (``elasticzero.engine``, ...): a module's imports are its package's."""
    top = {m: ".".join(m.split(".")[:2]) for m in graph}
    out: dict[str, set[str]] = {p: set() for p in top.values()}
    for m, imps in graph.items():
        out[top[m]] |= {top[i] for i in imps} - {top[m]}
    return out


def test_no_import_cycle_through_the_engine_or_the_checkpoint() -> None:
    for graph in (_graph(), _packages(_graph())):
        cycles = [c for m in sorted(graph) if _in(m, ACYCLIC) and (c := _cycle_from(graph, m))]
        assert cycles == []


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    """The scan is not vacuous: the checkpoint imports the engine (also inside a function: the DeepSpeed import's
    Checkpointer), and a known import inside a function body is found."""
    graph = _graph()
    assert "elasticzero.engine.zero.layout" in graph["elasticzero.checkpoint.planner"]
    assert "elasticzero.checkpoint.checkpointer" in graph["elasticzero.checkpoint.deepspeed_import"]
