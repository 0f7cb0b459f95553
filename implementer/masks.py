"""Masks: under the paged runtime the model forward builds no dense attention masks.

The fused attention masks by itself (``sparse_mode`` with the fixed 2048x2048 tile and the
actual sequence lengths), so the O(T^2) masks transformers builds for the packed ``[1, T]``
batch are skipped: every call of a ``masking_utils`` (or 4.3x ``modeling_attn_mask_utils``)
builder - directly or through a local
alias such as ``mask_function = create_causal_mask if ... else ...`` - becomes
``None if _in_paged_runtime() else <call>``. transformers 4.4x models build theirs in a
method of the model class, ``self._update_causal_mask(...)`` (a dense ``T x T`` mask for eager
attention); a call of such a method, defined in the file, is guarded the same way. Outside the
runtime the model builds its masks as before.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.implementer._command import FrameworkCommand
from kvskill.implementer.snippets import statements

HELPER = "_in_paged_runtime"
#: the guard this codemod emits; a call already under it is left alone
GUARDED = m.IfExp(test=m.Call(func=m.Name(HELPER)))
#: modules whose builders make dense masks: transformers >= 4.5x's ``masking_utils`` and the
#: ``modeling_attn_mask_utils`` (``_prepare_4d_causal_attention_mask``) of 4.3x-era code
MASKING_MODULE_SUFFIXES = ("masking_utils", "modeling_attn_mask_utils")
#: methods of transformers 4.4x model classes that build the dense mask
DENSE_MASK_METHODS = ("_update_causal_mask",)


def mask_builders(module: cst.Module) -> set[str]:
    """Names imported from a mask module (``create_causal_mask``,
    ``_prepare_4d_causal_attention_mask``, ...)."""
    names: set[str] = set()
    for node in m.findall(module, m.ImportFrom()):
        node = cst.ensure_type(node, cst.ImportFrom)
        dotted = cst.Module(body=[]).code_for_node(node.module) if node.module else ""
        if not dotted.endswith(MASKING_MODULE_SUFFIXES) or isinstance(node.names, cst.ImportStar):
            continue
        for alias in node.names:
            bound = alias.asname.name if alias.asname else alias.name
            names.add(cst.ensure_type(bound, cst.Name).value)
    return names


def _aliases(func: cst.FunctionDef, builders: set[str]) -> set[str]:
    """Local names bound to a builder, e.g. ``mask_function = a if cond else b``."""
    aliases: set[str] = set()
    for node in m.findall(func, m.Assign(targets=[m.AssignTarget(target=m.Name())])):
        node = cst.ensure_type(node, cst.Assign)
        value = node.value
        options = [value.body, value.orelse] if isinstance(value, cst.IfExp) else [value]
        if all(isinstance(o, cst.Name) and o.value in builders for o in options):
            aliases.add(cst.ensure_type(node.targets[0].target, cst.Name).value)
    return aliases


class SkipDenseMasksCommand(FrameworkCommand):
    """Guard every dense-mask builder call with ``_in_paged_runtime()``."""

    DESCRIPTION = "Build no dense attention masks under the paged runtime."

    def visit_Module(self, node: cst.Module) -> bool:
        self.builders = mask_builders(node)
        self.methods = {
            name for name in DENSE_MASK_METHODS if m.findall(node, m.FunctionDef(name=m.Name(name)))
        }
        self.local: list[set[str]] = []
        self.guarded = 0
        self.chained: set[cst.Call] = set()
        self.has_helper = bool(m.findall(node, m.FunctionDef(name=m.Name(HELPER))))
        return bool(self.builders or self.methods)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.local.append(self.builders | _aliases(node, self.builders))
        return True

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self.local.pop()
        return updated_node

    def visit_IfExp(self, node: cst.IfExp) -> bool:
        if m.matches(node, GUARDED):
            self.guarded += 1
        return True

    def leave_IfExp(self, original_node: cst.IfExp, updated_node: cst.IfExp) -> cst.IfExp:
        if m.matches(original_node, GUARDED):
            self.guarded -= 1
        return updated_node

    def _builds_mask(self, call: cst.Call) -> bool:
        func = call.func
        if isinstance(func, cst.Name):
            return func.value in self.local[-1]
        return m.matches(func, m.Attribute(value=m.Name("self"))) and (
            cst.ensure_type(func, cst.Attribute).attr.value in self.methods
        )

    def visit_Call(self, node: cst.Call) -> bool:
        # ``create_causal_mask(...).to(torch.bool)`` (mpt): the guard takes the whole chain,
        # since ``None.to(...)`` would fail
        inner = node.func.value if isinstance(node.func, cst.Attribute) else None
        if self.local and isinstance(inner, cst.Call) and self._builds_mask(inner):
            self.chained.add(inner)
        return True

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not self.local or self.guarded or original_node in self.chained:
            return updated_node
        inner = original_node.func.value if isinstance(original_node.func, cst.Attribute) else None
        if not (self._builds_mask(original_node) or inner in self.chained):
            return updated_node
        self.changed = True
        return cst.IfExp(
            test=cst.Call(func=cst.Name(HELPER)),
            body=cst.Name("None"),
            orelse=updated_node,
            lpar=[cst.LeftParen()],
            rpar=[cst.RightParen()],
        )

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if self.has_helper or not getattr(self, "changed", False):
            return updated_node
        helper = statements("framework_runtime_helper.py.j2", self.parser_config())
        helper[0] = helper[0].with_changes(
            leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(indent=False)]
        )
        body = list(updated_node.body)
        index = _after_imports(body)
        return updated_node.with_changes(body=[*body[:index], *helper, *body[index:]])


def _after_imports(body: list[cst.BaseStatement]) -> int:
    """Index just after the last top-level import (or __future__/docstring prologue)."""
    last = 0
    for index, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and any(
            isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
        ):
            last = index + 1
    return last
