"""Render the jinja2 code snippets the codemods insert, and parse them with libcst.

Rendering is strict (an undefined variable is an error) and every rendering is parsed before
it is inserted, so a broken template fails in the tests, never in a user's file.
"""

from __future__ import annotations

from functools import cached_property
from importlib import resources
from typing import Any

import jinja2
import libcst as cst


class Snippets:
    """Templates behind one jinja2 loader, rendered strictly and parsed with libcst."""

    def __init__(self, loader: jinja2.BaseLoader) -> None:
        self._loader = loader

    @cached_property
    def _environment(self) -> jinja2.Environment:
        return jinja2.Environment(
            loader=self._loader,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
            autoescape=False,
        )

    def render(self, name: str, **values: Any) -> str:
        """The template ``name`` rendered with ``values`` (StrictUndefined)."""
        return self._environment.get_template(name).render(**values)

    def statements(
        self, name: str, parser_config: cst.PartialParserConfig | None = None, **values: Any
    ) -> list[cst.BaseStatement]:
        """Top-level statements of a rendered template, ready to insert into any block.

        libcst re-indents nested statements from their position in the tree, so snippets are
        written at column 0.
        """
        text = self.render(name, **values)
        module = cst.parse_module(text, parser_config or cst.PartialParserConfig())
        body = list(module.body)
        if body and module.header:
            # comments before the first statement belong to it
            first = body[0]
            body[0] = first.with_changes(leading_lines=[*module.header, *first.leading_lines])
        return body

    def methods(
        self, name: str, parser_config: cst.PartialParserConfig | None = None, **values: Any
    ) -> list[cst.FunctionDef]:
        """Methods of the ``class _Snippet:`` a template defines, each led by one blank line.

        Templates write methods inside a class so their docstrings carry the indentation they
        will have in the converted file.
        """
        (snippet,) = self.statements(name, parser_config, **values)
        snippet = cst.ensure_type(snippet, cst.ClassDef)
        return [
            cst.ensure_type(f, cst.FunctionDef).with_changes(
                leading_lines=[cst.EmptyLine(indent=False)]
            )
            for f in snippet.body.body
        ]


def _load(name: str) -> str:
    return (resources.files("kvskill.templates") / name).read_text(encoding="utf-8")


#: the template files shipped in kvskill.templates (the only source of emitted code)
_FILES = Snippets(jinja2.FunctionLoader(_load))
render = _FILES.render
statements = _FILES.statements
methods = _FILES.methods
