"""Each package's import graph runs one way: no cycles, even through imports inside functions.

A late import (one inside a function) hides a cycle from the interpreter but not from this
graph, which counts every import statement of every runtime module as an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime"
PACKAGE = "kvskill.runtime"


def _module_name(path: Path, root: Path = RUNTIME, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _imported_modules(path: Path, known: set[str], name: str) -> set[str]:
    """Modules of KNOWN that ``path`` (module NAME) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from pkg import mod`` imports the submodule when there is one
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known)
    found.discard(name)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    paths = sorted(root.rglob("*.py"))
    names = {p: _module_name(p, root, package) for p in paths}
    known = set(names.values())
    return {names[p]: _imported_modules(p, known, names[p]) for p in paths}


def runtime_import_graph() -> dict[str, set[str]]:
    return import_graph(RUNTIME, PACKAGE)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_the_graph_sees_top_level_and_late_imports():
    graph = runtime_import_graph()
    # top-level absolute imports, and a relative one inside the ops package
    assert "kvskill.runtime.block_pool" in graph["kvskill.runtime.managers"]
    assert "kvskill.runtime.ops.reference" in graph["kvskill.runtime.ops"]
    # the package re-exports everything, so it reaches the engine
    assert "kvskill.runtime.engine" in _reachable(graph, PACKAGE)


#: the one known cycle: a forward's kernel reader (facts) reads a callee's kernel
#: (callee, einsum_attention) with the same readers, which call back for nested callees
KNOWN_CYCLES = {
    "implementer": {
        "kvskill.implementer.callee",
        "kvskill.implementer.einsum_attention",
        "kvskill.implementer.facts",
    }
}


@pytest.mark.parametrize(
    "package", ["runtime", "verify", "analyzer", "core", "skill", "implementer"]
)
def test_no_module_imports_itself_through_others(package):
    # A package __init__ only re-exports; submodules never import it, so leave it out.
    name = f"kvskill.{package}"
    graph = {k: v - {name} for k, v in import_graph(ROOT / package, name).items() if k != name}
    cycles = {m for m in graph if m in _reachable(graph, m)}
    assert cycles == KNOWN_CYCLES.get(package, set()), f"modules on an import cycle: {cycles}"


def test_cache_declarations_sit_below_the_managers():
    # Converted model code imports the declarations; they must not pull the block
    # bookkeeping in (KVCacheManager hands validation the managers' registry instead).
    graph = runtime_import_graph()
    reached = _reachable(graph, "kvskill.runtime.cache_info")
    assert "kvskill.runtime.managers" not in reached
    assert "kvskill.runtime.kv_cache_manager" not in reached
    assert "kvskill.runtime.cache_info" in _reachable(graph, "kvskill.runtime.kv_cache_manager")
