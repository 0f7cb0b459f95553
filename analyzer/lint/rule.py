"""The base class of lint rules: a stable id, a one-line docstring and examples.

Each rule keeps ``VALID`` and ``INVALID`` source examples beside its code; the test suite
runs every rule over its own examples (no finding on VALID, at least one on INVALID), so
the examples and the rule cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding


class Rule:
    """One check from the common-error table. Subclasses set the class attributes and
    implement ``check``; the first docstring line is the rule's summary."""

    id: ClassVar[str]  #: "KV001" ...; never reused, never renumbered
    name: ClassVar[str]  #: kebab-case slug, accepted by ``--disable`` like the id
    VALID: ClassVar[list[str]]
    INVALID: ClassVar[list[str]]

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        raise NotImplementedError  # pragma: no cover - every registered rule overrides it

    def finding(self, ctx: FileContext, node: cst.CSTNode, message: str, fix: str) -> Finding:
        line, column = ctx.position(node)
        return Finding(
            path=ctx.path,
            line=line,
            column=column,
            rule=self.id,
            name=self.name,
            message=message,
            fix=fix,
        )
