"""Click options shared by several commands, each defined once."""

from __future__ import annotations

from pathlib import Path

import click
from kvskill.core.kv_layouts import KV_LAYOUTS

OUTPUT_FORMATS_SIMPLE = ("table", "json")


def format_option(choices: tuple[str, ...] = OUTPUT_FORMATS_SIMPLE, default: str = "table"):
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(choices),
        default=default,
        show_default=True,
        help="Output format. 'json' prints exactly one JSON object on stdout.",
    )


attn_tp_size_option = click.option(
    "--attn-tp-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Attention tensor-parallel size; KV heads per rank = max(num_kv_heads // size, 1).",
)

#: tokens per block at most: the NPU operators take blocks of up to 512 tokens; far beyond
#: that a block is a typo (and would be allocated per request)
MAX_BLOCK_SIZE = 1 << 14

block_size_option = click.option(
    "--block-size",
    type=click.IntRange(min=1, max=MAX_BLOCK_SIZE),
    default=None,
    help="Tokens per KV block. apply/analyze: default 128. verify/run: the NPU takes a "
    "multiple of 128 in [128, 512] (default 128; run: the model's own); any size with "
    "--cpu-only-shapes (verify's default is then 4).",
)

#: NOTE: the one place KVSKILL_CPU_ONLY_SHAPES is read for the CLI (the test suite sets it)
cpu_only_shapes_option = click.option(
    "--cpu-only-shapes",
    is_flag=True,
    default=False,
    envvar="KVSKILL_CPU_ONLY_SHAPES",
    help="Do not check the operator calls against the NPU's limits (block sizes, head dims, "
    "dtypes), e.g. to run tiny blocks on the CPU. The report then says the conversion was NOT "
    "checked against the NPU limits. Default: checked (off unless KVSKILL_CPU_ONLY_SHAPES=1).",
)

config_overrides_option = click.option(
    "--config-overrides",
    default=None,
    metavar="KEY=VALUE,...",
    help="Override config keys before analysis, e.g. 'num_hidden_layers=4,sliding_window=64'. "
    "Values are parsed as JSON when they can be (numbers, true/false/null, lists). On a "
    "composite (vision-language) config, a key of the language model, plain or written "
    "text_config.KEY, sets its text_config; a key of both levels (dtype) sets both.",
)

trust_remote_code_option = click.option(
    "--trust-remote-code",
    is_flag=True,
    default=False,
    help="Allow executing modeling code that does not come from the installed transformers.",
)

prompt_file_option = click.option(
    "--prompt-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The task prompt; with --mode auto a '部署模式: 框架部署|独立部署' line in it decides "
    "the deploy mode (before progress.md beside the model or in the workspace, and runner "
    "detection).",
)

seed_option = click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed for weights and sampling."
)

dtype_option = click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Compute dtype.",
)

#: NOTE: the one place KVSKILL_LOG_LAYOUT is read; the runtime only takes ``log_layout=``.
log_layout_option = click.option(
    "--log-layout",
    is_flag=True,
    default=False,
    envvar="KVSKILL_LOG_LAYOUT",
    help="Log every cache view built (lines prefixed [non-contiguous-kv-cache]). "
    "Default: on when KVSKILL_LOG_LAYOUT=1.",
)

kv_layout_option = click.option(
    "--kv-layout",
    type=click.Choice(KV_LAYOUTS),
    default="contiguous",
    show_default=True,
    help="Cache layout the runtime gives the converted model: one dense tensor per cache, or "
    "one page pool cut into strided views (framework outputs only).",
)


existing_dir = click.Path(exists=True, file_okay=False, dir_okay=True, path_type=Path)

tp_option = click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=None,
    help="Tensor-parallel ranks (processes) to split the model over; default: the "
    "--attn-tp-size it was converted for (1). One process per rank, each with its own KV pool.",
)

tp_backend_option = click.option(
    "--tp-backend",
    type=click.Choice(["auto", "gloo", "hccl", "nccl"]),
    default="auto",
    show_default=True,
    help="torch.distributed backend of --tp > 1: auto is gloo on the CPU, hccl on an NPU.",
)
