"""``kvskill analyze``: decide the KV design of a model, with evidence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
from kvskill.core.errors import BadInputError
from kvskill.options import (
    attn_tp_size_option,
    block_size_option,
    config_overrides_option,
    format_option,
    prompt_file_option,
)

EPILOG = """\b
Examples:
  kvskill analyze qwen3
  kvskill analyze ./my-model --format json
  kvskill analyze deepseek_v3 --config-overrides num_hidden_layers=4 --attn-tp-size 8
  kvskill analyze gpt_oss --format md --write-progress progress.md
  kvskill analyze --schema > plan.schema.json

\b
Exit codes: 0 plan produced, 2 bad input, 3 model cannot be served.
"""


@click.command(epilog=EPILOG)
@click.argument("model", required=False)
@format_option(("table", "json", "yaml", "md"))
@click.option(
    "--mode",
    "deploy_mode",
    type=click.Choice(["auto", "framework", "standalone"]),
    default="auto",
    show_default=True,
    help="Deployment mode; 'auto' reads it from --prompt-file, then progress.md (beside the "
    "model, above it, or in the working directory), then detects it (a runner_*.py means "
    "standalone), else framework.",
)
@prompt_file_option
@config_overrides_option
@attn_tp_size_option
@block_size_option
@click.option(
    "--hbm-gb",
    type=click.FloatRange(min=0, min_open=True, max=1 << 20),
    default=None,
    help="Device memory in GiB for the plan.",
)
@click.option(
    "--kv-memory",
    type=str,
    default=None,
    help="Memory for the KV cache, e.g. '8GiB', '512M' (K/M/G and KiB/MiB/GiB are powers of "
    "1024, KB/MB/GB powers of 1000).",
)
@click.option(
    "--write-progress",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Add or update this model's 'KVCache selection' section in this Markdown progress "
    "file (other models' sections are kept).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also write a workspace for converting MODEL by hand: the Plan (kvskill_plan.json), "
    "config.json and the unconverted modeling file to edit; kvskill verify DIR "
    "--trust-remote-code then checks the edited model against the original.",
)
@click.option("--force", is_flag=True, help="With --out: replace a non-empty directory.")
@click.option(
    "--schema",
    is_flag=True,
    default=False,
    help="Print the JSON Schema of the Plan (the JSON this command and kvskill_plan.json hold) "
    "and exit; MODEL is not needed.",
)
def analyze(
    model: str | None,
    output_format: str,
    deploy_mode: str,
    prompt_file: Path | None,
    config_overrides: str | None,
    attn_tp_size: int,
    block_size: int | None,
    hbm_gb: float | None,
    kv_memory: str | None,
    write_progress: Path | None,
    out_dir: Path | None,
    force: bool,
    schema: bool,
) -> None:
    """Read MODEL's config and modeling code and decide its KV-cache design.

    MODEL is a model directory (config.json, optional modeling_*.py) or a model type of
    the installed transformers such as 'qwen3'. Nothing in MODEL is imported or executed.
    """
    from kvskill.analyzer import analyze_model
    from kvskill.analyzer.memory import parse_memory
    from kvskill.analyzer.report import render, update_progress
    from kvskill.core.overrides import parse_overrides

    if schema:
        from kvskill.analyzer.plan_schema import plan_schema

        click.echo(json.dumps(plan_schema(), indent=2))
        return
    if model is None:
        raise click.UsageError("missing argument MODEL (a model directory or a model type)")
    if hbm_gb is not None and not math.isfinite(hbm_gb):
        raise BadInputError(f"--hbm-gb {hbm_gb} is not a finite number of GiB")
    if out_dir is not None:
        from kvskill.implementer.writer import check_out_before_work

        check_out_before_work(out_dir, model, force)
    plan = analyze_model(
        model,
        deploy_mode=deploy_mode,
        config_overrides=parse_overrides(config_overrides),
        attn_tp_size=attn_tp_size,
        block_size=block_size,
        kv_memory_bytes=parse_memory(kv_memory),
        hbm_gb=hbm_gb,
        prompt_file=prompt_file,
    )
    from kvskill.implementer.preflight import with_apply_blockers

    plan = with_apply_blockers(plan)
    click.echo(render(plan, output_format))
    if out_dir is not None:
        _write_workspace(plan, out_dir, force)
    if write_progress is not None:
        changed = update_progress(write_progress, plan)
        state = "updated" if changed else "already up to date"
        click.echo(f"{write_progress}: KVCache selection {state}", err=True)


def _write_workspace(plan, out_dir: Path, force: bool) -> None:
    from kvskill.implementer.convert import ApplyOptions
    from kvskill.implementer.workspace import write_workspace

    result = write_workspace(plan, out_dir, ApplyOptions(force=force))
    click.echo(
        f"{out_dir}: hand-conversion workspace written; edit {result.modeling_file}, then run "
        f"kvskill verify {out_dir} --trust-remote-code",
        err=True,
    )
