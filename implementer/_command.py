"""The base of every framework codemod: a libcst command that carries the ConversionSpec."""

from __future__ import annotations

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
