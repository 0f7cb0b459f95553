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
#: added when the emitted state code uses them (Mamba mixers): name -> its module
STATE_IMPORTS_IF_USED: dict[str, str] = {
    "mamba": "kvskill.runtime.ops",
    "gather_ssm_states": "kvskill.runtime",
    "scatter_ssm_states_": "kvskill.runtime",
}


#: added when the emitted Legacy attention uses them: name -> its module
LEGACY_IMPORTS_IF_USED: dict[str, str] = {
    "legacy_attention_inputs": "kvskill.runtime",
    "packed_output": "kvskill.runtime",
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


#: the operators' module name, which vendor files may bind themselves
OPS_NAME = "torch_npu"
OPS_IMPORT = cst.parse_statement("from kvskill.runtime.ops import torch_npu\n")
#: ``from kvskill.runtime.ops import ..., torch_npu, ...``: the runtime's operators
OPS_IMPORT_LINE = m.SimpleStatementLine(
    body=[
        m.ImportFrom(
            module=m.Attribute(
                value=m.Attribute(value=m.Name("kvskill"), attr=m.Name("runtime")),
                attr=m.Name("ops"),
            ),
            names=[
                m.ZeroOrMore(),
                m.ImportAlias(name=m.Name(OPS_NAME), asname=None),
                m.ZeroOrMore(),
            ],
        )
    ]
)
OPS_NOTE = [
    cst.EmptyLine(comment=cst.Comment(line))
    for line in (
        "# kvskill: the converted attention calls the operators through kvskill.runtime.ops",
        "# (the real torch_npu where an NPU is present, the reference operators elsewhere).",
    )
]


def _binds_ops_name(stmt: cst.BaseStatement) -> bool:
    """STMT (module level) binds ``torch_npu`` itself (``import torch_npu``, ``torch_npu =
    None``...), not through the runtime's import."""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) or m.matches(stmt, OPS_IMPORT_LINE):
        return False
    for alias in m.findall(stmt, m.ImportAlias()):
        alias = cst.ensure_type(alias, cst.ImportAlias)
        bound = alias.asname.name if alias.asname else alias.name
        name = cst.Module(body=[]).code_for_node(bound).split(".")[0]
        if name == OPS_NAME:
            return True
    return bool(m.findall(stmt, m.AssignTarget(target=m.Name(OPS_NAME))))


def last_ops_binding(module: cst.Module) -> int | None:
    """Index of the last module-level statement binding ``torch_npu`` itself, or None."""
    found = [i for i, stmt in enumerate(module.body) if _binds_ops_name(stmt)]
    return found[-1] if found else None


class _RuntimeUses(cst.CSTVisitor):
    """What the runtime imports depend on, read in one walk of the module: whether a class
    declares ``self.cache_entries``, the names called (``name(...)``) and the names called
    through (``name.attr(...)``)."""

    def __init__(self) -> None:
        self.declares_caches = False
        self.called: set[str] = set()
        self.called_through: set[str] = set()

    def visit_Assign(self, node: cst.Assign) -> None:
        if not self.declares_caches and m.matches(node, CACHE_ENTRIES_ASSIGN):
            self.declares_caches = True

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Name):
            self.called.add(func.value)
        elif isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name):
            self.called_through.add(func.value.value)


class RuntimeImportsCommand(FrameworkCommand):
    """Import the runtime names once, when the file declares paged caches.

    A vendor file may bind ``torch_npu`` itself (``try: import torch_npu`` with ``torch_npu =
    None`` when it is missing); the runtime's ``torch_npu`` is then imported right after that
    binding, so the converted code calls the operators kvskill chose on every machine.
    """

    DESCRIPTION = (
        "Import CacheEntry, LayerCacheInfo, ModelCacheInfo, get_forward_metadata, torch_npu."
    )

    def visit_Module(self, node: cst.Module) -> bool:
        uses = _RuntimeUses()
        node.visit(uses)
        self.declares_caches = uses.declares_caches
        if uses.declares_caches:
            own = last_ops_binding(node) is not None
            AddImportsVisitor.add_needed_import(self.context, "torch")
            wanted = [RUNTIME_IMPORTS]
            if "MambaCacheEntry" in uses.called:
                wanted.append(STATE_IMPORTS)
                used = (uses.called | uses.called_through) & set(STATE_IMPORTS_IF_USED)
                for name in sorted(used):
                    wanted.append({STATE_IMPORTS_IF_USED[name]: (name,)})
            wanted.extend(
                {LEGACY_IMPORTS_IF_USED[name]: (name,)}
                for name in sorted(LEGACY_IMPORTS_IF_USED)
                if name in uses.called
            )
            for imports in wanted:
                for module, names in imports.items():
                    for name in names:
                        if not (own and name == OPS_NAME):
                            AddImportsVisitor.add_needed_import(self.context, module, name)
        return False

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        index = last_ops_binding(updated_node)
        if index is None or not self.declares_caches:
            return updated_node
        if any(m.matches(stmt, OPS_IMPORT_LINE) for stmt in updated_node.body[index + 1 :]):
            return updated_node  # already rebound after the file's own binding
        body = list(updated_node.body)
        body.insert(index + 1, OPS_IMPORT.with_changes(leading_lines=[cst.EmptyLine(), *OPS_NOTE]))
        return updated_node.with_changes(body=body)
