"""Imports: relative imports of transformers internals become absolute, and the runtime's
names are imported once.

A converted file no longer lives inside the transformers package, so ``from ...activations
import ACT2FN`` must name ``transformers.activations``. Relative imports in a model directory
(``from .configuration_foo import FooConfig``) stay: those files are copied next to the
converted one.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.implementer._command import FrameworkCommand
from kvskill.implementer.facts import CACHE_ENTRIES_ASSIGN
from libcst.codemod.visitors import AddImportsVisitor

#: names the converted code uses, by module
RUNTIME_IMPORTS: dict[str, tuple[str, ...]] = {
    "kvskill.runtime": ("CacheEntry", "LayerCacheInfo", "ModelCacheInfo", "get_forward_metadata"),
    "kvskill.runtime.ops": ("torch_npu",),
}
#: added when the file declares recurrent-state entries (gated delta nets)
STATE_IMPORTS: dict[str, tuple[str, ...]] = {
    "kvskill.runtime": ("MambaCacheEntry",),
    "kvskill.runtime.ops": ("fla",),
}


def _dotted(node: cst.BaseExpression | None) -> str:
    if node is None:
        return ""
    if isinstance(node, cst.Name):
        return node.value
    node = cst.ensure_type(node, cst.Attribute)
    return f"{_dotted(node.value)}.{node.attr.value}"


def _dotted_expr(dotted: str) -> cst.Attribute | cst.Name:
    return cst.ensure_type(cst.parse_expression(dotted), (cst.Attribute, cst.Name))  # type: ignore[arg-type]


class AbsoluteImportsCommand(FrameworkCommand):
    """Rewrite ``from .x import y`` into ``from <package>.x import y`` inside transformers."""

    DESCRIPTION = "Make relative imports of transformers internals absolute."

    def skip_function_bodies(self) -> bool:
        # imports inside functions are rare in modeling code but must be rewritten too
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return True

    def leave_ImportFrom(
        self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom
    ) -> cst.ImportFrom:
        if not updated_node.relative or self.package is None:
            return updated_node
        parts = self.package.split(".")
        level = len(updated_node.relative)
        if level > len(parts):
            return updated_node
        base = parts[: len(parts) - level + 1]
        module = ".".join([*base, _dotted(updated_node.module)] if updated_node.module else base)
        if not module.startswith("transformers"):
            return updated_node
        return updated_node.with_changes(relative=[], module=_dotted_expr(module))


class RuntimeImportsCommand(FrameworkCommand):
    """Import the runtime names once, when the file declares paged caches."""

    DESCRIPTION = (
        "Import CacheEntry, LayerCacheInfo, ModelCacheInfo, get_forward_metadata, torch_npu."
    )

    def visit_Module(self, node: cst.Module) -> bool:
        if m.findall(node, CACHE_ENTRIES_ASSIGN):
            AddImportsVisitor.add_needed_import(self.context, "torch")
            wanted = [RUNTIME_IMPORTS]
            if m.findall(node, m.Call(func=m.Name("MambaCacheEntry"))):
                wanted.append(STATE_IMPORTS)
            for imports in wanted:
                for module, names in imports.items():
                    for name in names:
                        AddImportsVisitor.add_needed_import(self.context, module, name)
        return False
