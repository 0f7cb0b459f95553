"""Render a lint report: a table for people, one JSON object for tools."""

from __future__ import annotations

import json

from kvskill.analyzer.lint.model import LintReport


def render_table(report: LintReport) -> str:
    """``file:line:col RULE message — fix`` per finding, then errors, then a summary line."""
    lines = [
        f"{f.path}:{f.line}:{f.column} {f.rule} {f.message} — fix: {f.fix}" for f in report.findings
    ]
    lines += [f"{e.path}:{e.line}: error: {e.message}" for e in report.errors]
    files = f"{report.files} file{'s' if report.files != 1 else ''}"
    if report.findings or report.errors:
        summary = f"{len(report.findings)} finding(s) in {files}"
        if report.errors:
            summary += f", {len(report.errors)} file(s) could not be checked"
    else:
        summary = f"{files} checked, no findings"
    lines.append(summary)
    return "\n".join(lines)


def render_json(report: LintReport) -> str:
    return json.dumps(report.to_dict(), indent=None)
