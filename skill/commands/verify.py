"""``kvskill verify``: prove a conversion token-exact against the original model."""

from __future__ import annotations

from pathlib import Path

import click
from kvskill.errors import NotImplementedYetError
from kvskill.options import (
    block_size_option,
    dtype_option,
    existing_dir,
    format_option,
    seed_option,
    trust_remote_code_option,
)

EPILOG = """\b
Examples:
  kvskill verify converted/
  kvskill verify converted/ --format json --no-shrink

\b
Exit codes: 0 tokens identical, logits within tolerance and the three chains hold,
1 a check failed, 2 bad input (e.g. remote code without --trust-remote-code).
"""


@click.command(epilog=EPILOG)
@click.argument("directory", type=existing_dir)
@click.option(
    "--shrink/--no-shrink",
    default=True,
    show_default=True,
    help="Shrink the config (keeping every structural feature) before comparing.",
)
@click.option("--num-prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--atol", type=float, default=None, help="Logit tolerance (default 1e-4 in float32).")
@block_size_option
@dtype_option
@seed_option
@trust_remote_code_option
@format_option()
def verify(directory: Path, **options) -> None:
    """Run the original and the converted model in DIRECTORY on the same prompts and
    compare greedy tokens, per-step logits and the init / runtime / release chains."""
    raise NotImplementedYetError("`kvskill verify` is not implemented yet")
