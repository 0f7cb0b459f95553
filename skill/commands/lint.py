"""``kvskill lint``: find the known KV-cache and fused-attention mistakes in model code."""

from __future__ import annotations

from pathlib import Path

import click
from kvskill.analyzer.lint import RULES, lint_paths, render_json, render_table
from kvskill.options import format_option

_RULE_LINES = "\n".join(f"  {r.id} {r.name}" for r in RULES)

EPILOG = f"""\b
Examples:
  kvskill lint converted/modeling_qwen3.py
  kvskill lint models/ --format json
  kvskill lint converted/ --disable KV006 --disable sliding-window-without-band

\b
Rules:
{_RULE_LINES}

\b
Output: one line per finding, `file:line:col RULE message — fix: ...`, then a summary.
--format json prints one object: {{"findings": [{{path, line, column, rule, name,
message, fix}}], "errors": [{{path, line, message}}], "files": N}}.

\b
Exit codes: 0 clean, 1 findings, 2 bad input: an unknown rule, a folder without Python
files, or a file that cannot be parsed when no finding was made elsewhere (such files
are listed as errors and the other files are still checked).
"""


@click.command(epilog=EPILOG)
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--disable", multiple=True, metavar="RULE", help="Skip a rule id (repeatable).")
@format_option()
def lint(paths: tuple[Path, ...], disable: tuple[str, ...], output_format: str) -> int:
    """Check model files (or folders of them) against the common-error table."""
    report = lint_paths(paths, disable=disable)
    if output_format == "json":
        click.echo(render_json(report))
    else:
        click.echo(render_table(report))
    return report.exit_code
