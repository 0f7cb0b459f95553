"""``kvskill lint``: find the known KV-cache and fused-attention mistakes in model code."""

from __future__ import annotations

from pathlib import Path

import click
from kvskill.errors import NotImplementedYetError
from kvskill.options import format_option

EPILOG = """\b
Examples:
  kvskill lint converted/modeling_qwen3.py
  kvskill lint models/ --format json

\b
Exit codes: 0 clean, 1 findings, 2 bad input.
"""


@click.command(epilog=EPILOG)
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--disable", multiple=True, metavar="RULE", help="Skip a rule id (repeatable).")
@format_option()
def lint(paths: tuple[Path, ...], **options) -> None:
    """Check model files (or folders of them) against the common-error table."""
    raise NotImplementedYetError("`kvskill lint` is not implemented yet")
