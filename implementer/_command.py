"""The base of every framework codemod, and the class-body edits the codemods share.

``FrameworkCommand`` is a libcst command that carries the ConversionSpec.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst
from kvskill.implementer.spec import ConversionSpec
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand


class FrameworkCommand(VisitorBasedCodemodCommand):
    """A codemod with one concern, parameterised by the analyzer's decisions."""

    def __init__(self, context: CodemodContext, spec: ConversionSpec) -> None:
        super().__init__(context)
        self.spec = spec

    def skip_function_bodies(self) -> bool:
        """Commands that rewrite whole classes do not descend into function bodies (they
        inspect them with matchers on ``original_node``); visiting every expression of a
        large modeling file several times is most of the cost of a conversion."""
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return not self.skip_function_bodies()

    def parser_config(self) -> cst.PartialParserConfig:
        """Parse snippets with the file's own newline and indentation conventions."""
        module = self.context.module
        if module is None:
            return cst.PartialParserConfig()
        return module.config_for_parsing


def replace_method(
    cls: cst.ClassDef, name: str, change: Callable[[cst.FunctionDef], cst.FunctionDef]
) -> list[cst.BaseStatement]:
    """The statements of CLS's body, with the method NAME replaced by ``change(method)``."""
    body = []
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            stmt = change(stmt)
        body.append(stmt)
    return body


def append_statements(function: cst.FunctionDef, stmts: list[cst.BaseStatement]) -> cst.FunctionDef:
    """FUNCTION with STMTS added after its last statement."""
    block = cst.ensure_type(function.body, cst.IndentedBlock)
    return function.with_changes(body=block.with_changes(body=[*block.body, *stmts]))
