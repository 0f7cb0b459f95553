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

    def parser_config(self) -> cst.PartialParserConfig:
        """Parse snippets with the file's own newline and indentation conventions."""
        module = self.context.module
        if module is None:
            return cst.PartialParserConfig()
        return module.config_for_parsing
