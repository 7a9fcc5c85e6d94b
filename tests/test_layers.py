"""The package's import picture, read from the source with ``ast``: every import
statement, at module level or inside a function, type-checking imports included.

Layers, lowest first: the engine (models, caches, sessions, decoding, the
sharding link), which imports nothing above it but leaf modules (those that
import nothing of kvchat: ``safety``, ``locations``...); the store (sessions on
disk); the modules that join the two (``runtime``: its pool, sessions, sharded files); the
front ends (cli, tui, serve, bench). No module imports from a layer above its own (a
type it names for the checker counts too), and no two modules import each other at
run time, directly or round a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvchat

ROOT = Path(kvchat.__file__).parent
ENGINE, STORE = "kvchat.engine", "kvchat.store"
FRONT_ENDS = ("kvchat.tui", "kvchat.serve", "kvchat.cli", "kvchat.bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def within(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


def imported(module: str, path: Path, typing: bool = True) -> set[str]:
    """The kvchat modules that ``module`` imports anywhere in its source (with ``typing``
    False, leaving out ``if TYPE_CHECKING:`` blocks, which never run): for ``from X
    import Y``, ``X.Y`` where that is a module of its own, else ``X``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    unrun = set()
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                unrun.update(id(inner) for part in node.body for inner in ast.walk(part))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in unrun:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imported(module, path) for module, path in MODULES.items()}
RUN = {module: imported(module, path, typing=False) for module, path in MODULES.items()}


def test_the_graph_is_read_from_every_kind_of_import():
    """The reader sees what the rules below rely on: absolute, relative, ``from package
    import module`` and imports inside functions (here, the CLI's lazy ones)."""
    assert "kvchat.engine.conversation.session" in GRAPH["kvchat.cli.replay"]
    assert "kvchat.safety" in GRAPH["kvchat.cli.replay"]  # from ..safety import ...
    assert "kvchat.store" in GRAPH["kvchat.cli.ask"]  # from kvchat import store, in ask()
    assert "kvchat.cli.common" in GRAPH["kvchat.cli.ask"]  # from .common import ...
    assert "kvchat.engine.caches.kinds" in GRAPH["kvchat.engine.sharding.driver"]
    assert "kvchat.engine.caches.kinds" in RUN["kvchat.engine.sharding.driver"]
    # a Protocol only, for the checker: in the layer picture, never run
    assert "kvchat.tui.app_view" in GRAPH["kvchat.tui.tabs"] - RUN["kvchat.tui.tabs"]
    assert len(MODULES) > 100 and all(RUN[m] <= GRAPH[m] <= MODULES.keys() for m in GRAPH)


def upward(layer: str, allowed) -> list[str]:
    """Each import of a module of ``layer`` whose target is outside it and not ``allowed``."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if within(module, layer)
        for target in targets
        if not within(target, layer) and not allowed(target)
    )


def test_the_engine_imports_nothing_above_it_but_leaf_modules():
    leaves = {module for module, targets in GRAPH.items() if not targets}
    assert {"kvchat.safety", "kvchat.locations"} <= leaves and STORE not in leaves

    def allowed(target: str) -> bool:
        return target in leaves and not within(target, STORE)

    assert upward(ENGINE, allowed) == []


def test_the_store_imports_no_front_end_and_nothing_that_imports_the_store():
    above = {
        module
        for module, targets in GRAPH.items()
        if not within(module, STORE) and any(within(t, STORE) for t in targets)
    }
    assert {
        "kvchat.runtime.pool",
        "kvchat.runtime.sessions",
        "kvchat.runtime.sharded.disk",
    } <= above

    def allowed(target: str) -> bool:
        return target not in above and not any(within(target, f) for f in FRONT_ENDS)

    assert upward(STORE, allowed) == []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for module in graph:
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_modules_import_each_other_even_for_the_checker():
    """No circle anywhere in the package, counting imports that run (at module level or in
    a function) and those made for the type checker only (``if TYPE_CHECKING:``): a
    collaborator gets what it needs passed in (a small Protocol, or the pieces), never its
    owner imported back; a type two modules share lives below both."""
    assert circles(RUN) == []
    assert circles(GRAPH) == []


def test_a_circle_is_found_however_far_round_it_goes():
    """The finder itself: a circle of three modules beside a module outside it."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
