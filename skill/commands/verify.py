"""``kvskill verify``: prove a conversion token-exact against the original model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
from kvskill.core.errors import BadInputError, ExitCode
from kvskill.options import (
    block_size_option,
    cpu_only_shapes_option,
    dtype_option,
    existing_dir,
    format_option,
    kv_layout_option,
    seed_option,
    tp_backend_option,
    tp_option,
    trust_remote_code_option,
)
from kvskill.verify.verdict import DRIFT_RATIO

EPILOG = """\b
Examples:
  kvskill verify converted/                  # its real weights if it has some, else a twin
  kvskill verify converted/ --shrink         # a shrunk random-weight twin
  kvskill verify converted/ --prompts prompts.txt --dtype bfloat16
  kvskill verify converted/ --kv-layout page_pool
  kvskill verify converted/ --cpu-only-shapes --block-size 4   # not checked against NPU limits

\b
By default the runtime's operator calls are checked against the NPU's limits (block size
128; head dims when the real config runs; dtypes in float16/bfloat16): the report says what
was and was not checked. float32 is a CPU-only convenience of the reference.

\b
Exit codes: 0 the models agree (float32: tokens identical and logits within tolerance;
float16/bfloat16: drift within the noise-floor rule) and the three chains hold,
1 a check failed (an operator call the NPU refuses included), 2 bad input (e.g. remote
code without --trust-remote-code, a block size the NPU does not take).
"""


@click.command(epilog=EPILOG)
@click.argument("directory", type=existing_dir)
@click.option(
    "--shrink/--no-shrink",
    default=None,
    help="--shrink: check a shrunk random-weight twin (every structural feature kept). "
    "--no-shrink: the full config, on the directory's weights if it has some. Default: the "
    "directory's weights when present and they fit in memory, else the shrunk twin.",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Prompts, one per line: token ids (1,2,3) or text (needs the checkpoint's tokenizer "
    "files in DIR or its source directory; never downloaded). Replaces --num-prompts.",
)
@click.option("--num-prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--atol",
    type=click.FloatRange(min=0, max=1e6),
    default=None,
    help="Absolute logit tolerance (default 1e-4 in float32), plus 16 float32 ulps of the "
    "largest reference logit. In float16/bfloat16: the atol of the floor added to the allowed drift "
    "(the same default).",
)
@click.option(
    "--drift-ratio",
    type=click.FloatRange(min=1, max=1e3),
    default=DRIFT_RATIO,
    show_default=True,
    help="float16/bfloat16: the converted model's drift from the float32 original may be this "
    "many times the original's own drift in that dtype (plus the floor).",
)
@click.option(
    "--graph",
    is_flag=True,
    help="Run the converted model's decode steps as graphs captured per batch bucket "
    "(torch.compile, as `run --graph`), compared against the original like the eager run. "
    "Framework outputs only.",
)
@kv_layout_option
@tp_option
@tp_backend_option
@block_size_option
@cpu_only_shapes_option
@dtype_option
@seed_option
@trust_remote_code_option
@format_option()
def verify(directory: Path, output_format: str, **options) -> int:
    """Run the original and the converted model in DIRECTORY on the same prompts and
    compare greedy tokens, per-step logits and the init / runtime / release chains."""
    # imported here so that `kvskill --help` and the other verbs start without torch
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions
    from kvskill.verify.table import format_table

    if options["atol"] is not None and math.isnan(options["atol"]):
        raise BadInputError("--atol nan is not a tolerance; give a number >= 0")
    if math.isnan(options["drift_ratio"]):
        raise BadInputError("--drift-ratio nan is not a ratio; give a number >= 1")
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
        prompts_file=options["prompts_file"],
        drift_ratio=options["drift_ratio"],
        tensor_parallel_size=options["tp"],
        tp_backend=options["tp_backend"],
        cpu_only_shapes=options["cpu_only_shapes"],
        graph=options["graph"],
    )
    # one verify: a standalone output's record names its runner, which drives the model
    report = verify_directory(directory, verify_options)
    if output_format == "json":
        click.echo(json.dumps(report.to_dict()))
    else:
        click.echo(format_table(report))
    return 0 if report.passed else int(ExitCode.CHECK_FAILED)
