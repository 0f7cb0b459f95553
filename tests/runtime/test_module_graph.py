"""The runtime's import graph runs one way: no cycles, even through imports inside functions.

A late import (one inside a function) hides a cycle from the interpreter but not from this
graph, which counts every import statement of every runtime module as an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
PACKAGE = "kvskill.runtime"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(RUNTIME).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """Runtime modules ``path`` imports anywhere in its body (absolute or relative)."""
    name = _module_name(path)
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


def runtime_import_graph() -> dict[str, set[str]]:
    paths = sorted(RUNTIME.rglob("*.py"))
    known = {_module_name(p) for p in paths}
    return {_module_name(p): _imported_modules(p, known) for p in paths}


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


def test_no_runtime_module_imports_itself_through_others():
    # The package __init__ only re-exports; submodules never import it, so leave it out.
    graph = {k: v - {PACKAGE} for k, v in runtime_import_graph().items() if k != PACKAGE}
    cycles = sorted(m for m in graph if m in _reachable(graph, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_cache_declarations_sit_below_the_managers():
    # Converted model code imports the declarations; they must not pull the block
    # bookkeeping in (KVCacheManager hands validation the managers' registry instead).
    graph = runtime_import_graph()
    reached = _reachable(graph, "kvskill.runtime.cache_info")
    assert "kvskill.runtime.managers" not in reached
    assert "kvskill.runtime.kv_cache_manager" not in reached
    assert "kvskill.runtime.cache_info" in _reachable(graph, "kvskill.runtime.kv_cache_manager")
