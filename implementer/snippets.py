"""Render the jinja2 code snippets the codemods insert, and parse them with libcst.

Rendering is strict (an undefined variable is an error) and every rendering is parsed before
it is inserted, so a broken template fails in the tests, never in a user's file.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2
import libcst as cst
from kvskill.resources import templates_dir


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    templates = templates_dir()

    def load(name: str) -> str:
        return (templates / name).read_text(encoding="utf-8")

    return jinja2.Environment(
        loader=jinja2.FunctionLoader(load),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(name: str, **values: Any) -> str:
    """The template ``name`` rendered with ``values`` (StrictUndefined)."""
    return _environment().get_template(name).render(**values)


def statements(
    name: str, parser_config: cst.PartialParserConfig | None = None, **values: Any
) -> list[cst.BaseStatement]:
    """Top-level statements of a rendered template, ready to insert into any block.

    libcst re-indents nested statements from their position in the tree, so snippets are
    written at column 0.
    """
    text = render(name, **values)
    module = cst.parse_module(text, parser_config or cst.PartialParserConfig())
    body = list(module.body)
    if body and module.header:
        # comments before the first statement belong to it
        first = body[0]
        body[0] = first.with_changes(leading_lines=[*module.header, *first.leading_lines])
    return body


def methods(
    name: str, parser_config: cst.PartialParserConfig | None = None, **values: Any
) -> list[cst.FunctionDef]:
    """Methods of the ``class _Snippet:`` a template defines, each led by one blank line.

    Templates write methods inside a class so their docstrings carry the indentation they
    will have in the converted file.
    """
    (snippet,) = statements(name, parser_config, **values)
    snippet = cst.ensure_type(snippet, cst.ClassDef)
    return [
        cst.ensure_type(f, cst.FunctionDef).with_changes(
            leading_lines=[cst.EmptyLine(indent=False)]
        )
        for f in snippet.body.body
    ]
