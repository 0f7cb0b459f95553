"""``kvskill apply``: rewrite a model so its KV cache is paged."""

from __future__ import annotations

import json
from pathlib import Path

import click
from kvskill.core.errors import BadInputError
from kvskill.core.overrides import parse_overrides
from kvskill.options import (
    attn_tp_size_option,
    block_size_option,
    config_overrides_option,
    format_option,
    prompt_file_option,
)

EPILOG = """\b
Examples:
  kvskill apply qwen3 --mode framework --out converted/
  kvskill apply ./my-model --mode framework --out converted/ --dry-run
  kvskill apply qwen3 --mode standalone --kv-mode paged --out runner/
  kvskill analyze qwen3 --format json > plan.json   # review, edit fa_version ...
  kvskill apply qwen3 --plan plan.json --out converted/

\b
--plan converts what the reviewed plan says. Its choices (deploy_mode, fa_version,
block_size, attn_tp_size) may be edited by hand; every other field is a fact of the model,
and a plan whose facts no longer match MODEL is refused (exit 2) naming them.

\b
Exit codes: 0 written, 2 bad input (or DIR not empty without --force),
3 model not supported by the implementer (nothing written).
"""


@click.command(epilog=EPILOG)
@click.argument("model")
@click.option(
    "--mode",
    "deploy_mode",
    type=click.Choice(["auto", "framework", "standalone"]),
    default="auto",
    show_default=True,
    help="framework: the bundled runtime owns the cache; standalone: a generated runner does; "
    "auto: as kvskill analyze decides it (--prompt-file, progress.md beside the model or in "
    "the workspace, a "
    "runner_*.py), else framework.",
)
@prompt_file_option
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output directory (required unless --dry-run).",
)
@click.option(
    "--fa-version",
    type=click.Choice(["auto", "v1", "v2"]),
    default="auto",
    show_default=True,
    help="Fused-attention operator version; 'auto' follows the analyzer.",
)
@click.option(
    "--kv-mode",
    type=click.Choice(["auto", "paged", "legacy", "contiguous"]),
    default="auto",
    show_default=True,
    help="KV design: 'auto' follows the Plan (paged unless it chose legacy). Framework mode "
    "writes paged or legacy; standalone mode writes paged (mode 2) or contiguous = legacy "
    "(mode 1, BSH). A value the mode cannot write is an error, never ignored.",
)
@click.option(
    "--mla-absorb",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="MLA models: absorb the up-projections into query and output.",
)
@click.option(
    "--target",
    type=click.Choice(["runtime", "cann-recipes"]),
    default="runtime",
    show_default=True,
    help="Framework mode's host: kvskill's runtime, or cann-recipes-infer's executor (fbc225d): "
    "adds models/<name>/ (modeling file in the executor's model-class contract, configuration "
    "module, YAML config, support_models entry), which kvskill verify and run host too.",
)
@attn_tp_size_option
@block_size_option
@config_overrides_option
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Convert what this reviewed plan (kvskill analyze --format json) says; it decides "
    "--mode, --fa-version, --block-size and --attn-tp-size.",
)
@click.option("--dry-run", is_flag=True, help="Print a unified diff; write nothing.")
@click.option("--force", is_flag=True, help="Overwrite a non-empty output directory.")
@click.option(
    "--weights",
    "weights_mode",
    type=click.Choice(["link", "copy"]),
    default="link",
    show_default=True,
    help="How MODEL's weight files reach DIR: relative symlinks (DIR and MODEL can move "
    "together) or copies (DIR stands alone).",
)
@click.option("--copy-weights", is_flag=True, help="The same as --weights copy.")
@format_option()
def apply(model: str, **options) -> None:
    """Rewrite MODEL so it declares cache_entries, implements get_cache_info and calls
    the fused-attention and scatter operators.

    The input files are never modified; the result goes to --out. Model code is parsed with
    libcst, never executed.
    """
    # imported here: the rewrite (libcst, the analyzer) loads only when a command needs it
    from kvskill.implementer.writer import ApplyOptions, apply_model

    if options["plan_file"] is not None:
        _refuse_mode_with_plan()
    apply_options = ApplyOptions(
        deploy_mode=options["deploy_mode"],
        fa_version=options["fa_version"],
        attn_tp_size=options["attn_tp_size"],
        block_size=options["block_size"],
        config_overrides=parse_overrides(options["config_overrides"]),
        dry_run=options["dry_run"],
        force=options["force"],
        copy_weights=options["copy_weights"] or options["weights_mode"] == "copy",
        mla_absorb=options["mla_absorb"],
        kv_mode=options["kv_mode"],
        plan_file=options["plan_file"],
        prompt_file=options["prompt_file"],
        target=options["target"],
    )
    result = apply_model(model, options["out_dir"], apply_options)
    if options["output_format"] == "json":
        data = result.to_dict()
        data["dry_run"] = options["dry_run"]
        if options["dry_run"]:
            data["diff"] = result.diff
        click.echo(json.dumps(data))
        return
    if options["dry_run"]:
        click.echo(result.diff, nl=False)
        click.echo(
            f"kvskill: dry run: {result.modeling_file} "
            f"{'would change' if result.changed else 'is already converted'}; nothing written",
            err=True,
        )
        return
    click.echo(
        f"kvskill: wrote {result.out_dir}: "
        + ", ".join(f"{name} ({how})" for name, how in result.files.items()),
        err=True,
    )


def _refuse_mode_with_plan() -> None:
    """``--mode`` given with ``--plan``: the plan's deploy_mode decides (edit it there)."""
    ctx = click.get_current_context()
    if ctx.get_parameter_source("deploy_mode") is click.core.ParameterSource.COMMANDLINE:
        raise BadInputError(
            "--mode with --plan: the plan's deploy_mode decides it, edit deploy_mode there instead"
        )
