"""``kvskill lint``: libcst checks for the known KV-cache and fused-attention mistakes.

Each rule has a stable id (KV001...), a one-line summary and VALID / INVALID examples kept
beside it. Rules favour precision: they report only what they can see for certain, so a
clean result on correct code is the norm, not luck.
"""

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import FileError, Finding, LintReport
from kvskill.analyzer.lint.report import render_json, render_table
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules import RULES
from kvskill.analyzer.lint.runner import lint_paths, lint_source, python_files, select_rules

__all__ = [
    "RULES",
    "FileContext",
    "FileError",
    "Finding",
    "LintReport",
    "Rule",
    "lint_paths",
    "lint_source",
    "python_files",
    "render_json",
    "render_table",
    "select_rules",
]
