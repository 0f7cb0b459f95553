"""``kvskill verify``: prove a conversion token-exact against the original model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
from kvskill.core.errors import BadInputError, ExitCode
from kvskill.implementer.report import format_table
from kvskill.implementer.verify import VerifyOptions, verify_directory
from kvskill.options import (
    block_size_option,
    dtype_option,
    existing_dir,
    format_option,
    kv_layout_option,
    seed_option,
    trust_remote_code_option,
)

EPILOG = """\b
Examples:
  kvskill verify converted/
  kvskill verify converted/ --format json --no-shrink
  kvskill verify converted/ --kv-layout page_pool

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
@click.option(
    "--atol",
    type=click.FloatRange(min=0, max=1e6),
    default=None,
    help="Absolute logit tolerance (default 1e-4 in float32), plus 16 float32 ulps of the "
    "largest reference logit.",
)
@kv_layout_option
@block_size_option
@dtype_option
@seed_option
@trust_remote_code_option
@format_option()
def verify(directory: Path, output_format: str, **options) -> int:
    """Run the original and the converted model in DIRECTORY on the same prompts and
    compare greedy tokens, per-step logits and the init / runtime / release chains."""
    if options["atol"] is not None and math.isnan(options["atol"]):
        raise BadInputError("--atol nan is not a tolerance; give a number >= 0")
    verify_options = VerifyOptions(
        shrink=options["shrink"],
        num_prompts=options["num_prompts"],
        max_new_tokens=options["max_new_tokens"],
        atol=options["atol"],
        block_size=options["block_size"],
        dtype=options["dtype"],
        seed=options["seed"],
        trust_remote_code=options["trust_remote_code"],
        kv_layout=options["kv_layout"],
    )
    # one verify: a standalone output's record names its runner, which drives the model
    report = verify_directory(directory, verify_options)
    if output_format == "json":
        click.echo(json.dumps(report.to_dict()))
    else:
        click.echo(format_table(report))
    return 0 if report.passed else int(ExitCode.CHECK_FAILED)
