"""The import graph of elasticzero's modules (and the shipped launcher plugins), read from the source, not by importing
it: every ``import`` counts wherever it stands (module level, inside a function, under ``TYPE_CHECKING``), because a
lazy import still makes two modules depend on each other.

- No import circles between modules.
- No arrow up the layers of docs/architecture.md: a module imports only the shared modules, its own layer and the
  layers below its own (:data:`BELOW`, the diagram written as data).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "src" / "elasticzero", ROOT / "plugins" / "elasticzero_plugins")
#: shared by every piece (docs/architecture.md, "Shared by every piece"); they import only each other. The package
#: itself is one: its ``__init__`` is lazy names only
SHARED = tuple(
    f"elasticzero{m}"
    for m in ("", ".errors", ".proc", ".fileio", "._lazy", ".torchcompat", ".device", ".progress", ".rounds")
)
#: the layers, as docs/architecture.md draws them (``a ← b``: b sits on a): each layer and the layers right below it.
#: A module's layer is the longest name here that it is or lies in
BELOW: dict[str, tuple[str, ...]] = {
    "elasticzero.config": (),
    "elasticzero.rendezvous": ("elasticzero.config",),
    "elasticzero.agent": ("elasticzero.config",),
    "elasticzero.launch": ("elasticzero.rendezvous", "elasticzero.agent"),
    "elasticzero.engine": ("elasticzero.config",),
    "elasticzero.checkpoint": ("elasticzero.engine",),
    "elasticzero.config.build": ("elasticzero.checkpoint",),  # the builder of the engine pieces from a config
    "elasticzero.data": ("elasticzero.config", "elasticzero.engine"),
    "elasticzero.live": ("elasticzero.engine", "elasticzero.data", "elasticzero.checkpoint"),  # Training: its saves
    "elasticzero.autotune": ("elasticzero.launch", "elasticzero.engine"),  # the engine: the measure window's timers
    # the front doors (HF Trainer, accelerate, Lightning): the training object, and the engine pieces from a config
    "elasticzero.integrations": ("elasticzero.live", "elasticzero.config.build"),
    "elasticzero.entry": ("elasticzero.autotune",),  # elasticzero-launch: the launcher, or --autotuning the tuner
    "elasticzero_plugins": ("elasticzero.launch",),  # the launcher backends
}


@functools.cache
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


def _layer(module: str) -> str | None:
    """The layer ``module`` lies in (:data:`BELOW`'s longest match; ``None``: shared or in none)."""
    if module in SHARED:
        return None
    found = [layer for layer in BELOW if _in(module, (layer,))]
    return max(found, key=len) if found else None


def _under(layer: str) -> set[str]:
    """Every layer below ``layer``, directly or through others."""
    out: set[str] = set()
    todo = list(BELOW[layer])
    while todo:
        below = todo.pop()
        if below not in out:
            out.add(below)
            todo.extend(BELOW[below])
    return out


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import that runs up (or across) the layers, as ``a -> b (layer of a -> layer of b)``."""
    bad = []
    for m, targets in sorted(edges.items()):
        mine = _layer(m)
        for t in sorted(targets):
            theirs = _layer(t)
            if t in SHARED or theirs == mine or (mine is not None and theirs in _under(mine)):
                continue
            bad.append(f"{m} -> {t} ({mine or 'shared'} -> {theirs})")
    return bad


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


def test_every_module_has_a_layer() -> None:
    assert [m for m in _modules() if m not in SHARED and _layer(m) is None] == [], "add it to BELOW or SHARED"
    assert all(below in BELOW for belows in BELOW.values() for below in belows)


def test_the_layers_are_a_hierarchy() -> None:
    assert [layer for layer in BELOW if layer in _under(layer)] == []  # no layer below itself


def test_no_import_runs_up_the_layers() -> None:
    bad = _upward(_edges(_modules()))
    assert bad == [], (
        "imports against docs/architecture.md's layers: " + "; ".join(bad) + "; move the shared piece down"
    )


def test_the_layer_check_sees_an_arrow_up() -> None:
    edges = {
        "elasticzero.agent.cli": {"elasticzero.launch.execute"},  # the agent reaching up into the launcher
        "elasticzero.launch.cli": {"elasticzero.autotune.cli", "elasticzero.agent.plan", "elasticzero.config.load"},
        "elasticzero.config.load": {"elasticzero.config.build"},  # config's builder sits above the engine
        "elasticzero.proc": {"elasticzero.agent.cli"},  # a shared module reaching into a layer
        "elasticzero.live.loop": {"elasticzero.rounds", "elasticzero.data.sampler", "elasticzero.config.schema"},
        "elasticzero.checkpoint.disk": {"elasticzero.data.sampler"},  # across: data is no layer below checkpoint
    }
    assert _upward(edges) == [
        "elasticzero.agent.cli -> elasticzero.launch.execute (elasticzero.agent -> elasticzero.launch)",
        "elasticzero.checkpoint.disk -> elasticzero.data.sampler (elasticzero.checkpoint -> elasticzero.data)",
        "elasticzero.config.load -> elasticzero.config.build (elasticzero.config -> elasticzero.config.build)",
        "elasticzero.launch.cli -> elasticzero.autotune.cli (elasticzero.launch -> elasticzero.autotune)",
        "elasticzero.proc -> elasticzero.agent.cli (shared -> elasticzero.agent)",
    ]
