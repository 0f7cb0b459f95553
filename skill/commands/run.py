"""``kvskill run``: generate with a converted model in the bundled runtime."""

from __future__ import annotations

from pathlib import Path

import click
from kvskill.errors import NotImplementedYetError
from kvskill.options import (
    block_size_option,
    dtype_option,
    existing_dir,
    format_option,
    log_layout_option,
    seed_option,
    trust_remote_code_option,
)

EPILOG = """\b
Examples:
  kvskill run converted/ --random-weights --num-requests 16 --prompt-len 64 --max-tokens 32
  kvskill run converted/ --prompt-ids 1,2,3,4 --max-tokens 8 --format json
  kvskill run converted/ --prompt-ids prompts.jsonl --kv-memory 256MiB

\b
Exit codes: 0 success, 2 bad input.
"""


@click.command(epilog=EPILOG)
@click.argument("directory", type=existing_dir)
@click.option(
    "--prompt-ids",
    default=None,
    help="Prompt token ids: a comma list, or a .json/.jsonl file of id lists.",
)
@click.option("--num-requests", type=click.IntRange(min=1), default=None, help="Synthetic load.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=1.0, show_default=True)
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@block_size_option
@click.option("--num-blocks", type=click.IntRange(min=2), default=None, help="KV blocks.")
@click.option("--kv-memory", default=None, help="KV memory budget, e.g. '256MiB'.")
@click.option("--random-weights", is_flag=True, help="Initialise random weights when DIR has none.")
@log_layout_option
@dtype_option
@seed_option
@trust_remote_code_option
@format_option()
def run(directory: Path, **options) -> None:
    """Generate with the converted model in DIRECTORY (continuous batching, paged KV)."""
    raise NotImplementedYetError("`kvskill run` is not implemented yet")
