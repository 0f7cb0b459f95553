"""Locate the files shipped as package data: SKILL.md, references/ and templates/.

Works the same from an editable checkout and from an installed wheel, because every lookup
goes through ``importlib.resources``.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

SKILL_NAME = "model-infer-kvcache"


def skill_md() -> Traversable:
    """The agent-facing SKILL.md."""
    return resources.files("kvskill") / "SKILL.md"


def references_dir() -> Traversable:
    """The folder of reference pages that SKILL.md links to."""
    return resources.files("kvskill.references")


def templates_dir() -> Traversable:
    """The folder of jinja2 templates used by the implementer."""
    return resources.files("kvskill.templates")


def reference_pages() -> list[Traversable]:
    """Every Markdown reference page, sorted by name."""
    return sorted(
        (p for p in references_dir().iterdir() if p.name.endswith(".md")),
        key=lambda p: p.name,
    )
