"""``kvskill run``: generate with a converted model in the bundled runtime."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from kvskill.commands.run_options import (
    device_option,
    exact_option,
    fuse_layers_option,
    graph_option,
    kv_memory_option,
    max_model_len_option,
    max_num_batched_tokens_option,
    max_num_seqs_option,
    num_blocks_option,
    prefix_caching_option,
    prepack_linear_option,
    random_weights_option,
    screen_output_head_option,
    speculative_tokens_option,
)
from kvskill.commands.run_report import Progress, print_report, run_report
from kvskill.commands.run_standalone import run_standalone
from kvskill.commands.run_workload import (
    Workload,
    parse_prompt_ids,
    size_for_workload,
    workload_options,
)
from kvskill.core.errors import BadInputError
from kvskill.core.sizes import parse_size as core_parse_size
from kvskill.options import (
    block_size_option,
    cpu_only_shapes_option,
    dtype_option,
    existing_dir,
    format_option,
    kv_layout_option,
    log_layout_option,
    seed_option,
    tp_backend_option,
    tp_option,
    trust_remote_code_option,
)

if TYPE_CHECKING:
    from kvskill.runtime.engine_config import EngineConfig

__all__ = ["engine_config_from_options", "parse_prompt_ids", "parse_size", "run", "tp_size_for"]

EPILOG = """\b
Examples:
  kvskill run converted/ --random-weights --num-requests 16 --prompt-len 64 --max-tokens 32
  kvskill run converted/ --prompt-ids 1,2,3,4 --max-tokens 8 --format json
  kvskill run converted/ --prompt-ids '1,2,3;7,8' --num-blocks 64 --block-size 16
  kvskill run converted/ --prompt-ids prompts.jsonl --kv-memory 256MiB
  kvskill run converted/ --random-weights --num-requests 2 --dtype bfloat16   # NPU dtypes too
  kvskill run converted/ --prompt-ids 1,2,3 --block-size 16 --cpu-only-shapes

\b
--prompt-ids takes one comma list, several separated by ';', or a .json file (a list of id
lists) / .jsonl file (one id list per line).

\b
Every step's operator calls are checked against the NPU's limits (block sizes, head dims;
dtypes in float16/bfloat16) unless --cpu-only-shapes; the report says what was checked.

\b
Fast by default: prepacked linears, fused layers and the screened output head run where this
machine and model allow them (the report names each, and why any is off); --exact runs the
model's own code bit for bit.

\b
Exit codes: 0 success, 1 an operator call the NPU refuses, 2 bad input (e.g. a block
size the NPU does not take), 3 unsupported model.
"""


def parse_size(text: str) -> int:
    """``--kv-memory``: the size parser every verb uses (``kvskill.core.sizes``)."""
    size = core_parse_size(text, option="--kv-memory")
    assert size is not None
    return size


@click.command(epilog=EPILOG)
@click.argument("directory", type=existing_dir)
@workload_options
@block_size_option
@cpu_only_shapes_option
@num_blocks_option
@kv_memory_option
@max_model_len_option
@max_num_batched_tokens_option
@max_num_seqs_option
@prefix_caching_option
@exact_option
@prepack_linear_option
@fuse_layers_option
@screen_output_head_option
@graph_option
@speculative_tokens_option
@device_option
@random_weights_option
@tp_option
@tp_backend_option
@kv_layout_option
@log_layout_option
@dtype_option
@seed_option
@trust_remote_code_option
@format_option()
def run(directory: Path, output_format: str, kv_layout: str, tp: int | None, **options) -> None:
    """Generate with the converted model in DIRECTORY (continuous batching, paged KV).

    A standalone output (it holds runner_<model>.py) is run by its own runner instead: one
    static batch, greedy."""
    from kvskill.implementer.record import PLAN_FILE, ConvertedDir
    from kvskill.runtime import LLM
    from kvskill.runtime.ops import check_run_block_size, run_profile

    config = engine_config_from_options(options, kv_layout=kv_layout, tensor_parallel_size=tp or 1)
    workload = Workload.from_options(options)
    profile = run_profile(
        cpu_only_shapes=config.cpu_only_shapes, dtype=config.dtype_name, real_dims=True
    )
    if profile.shapes and config.block_size is not None:  # before the model is loaded
        check_run_block_size(config.block_size)

    # a directory apply wrote says who runs it; one without a record is framework code
    if (directory / PLAN_FILE).is_file():
        from kvskill.verify.flow import check_layout_fits

        converted = ConvertedDir.read(directory)
        converted.check_layout(kv_layout)
        if converted.is_standalone:
            run_standalone(directory, config, workload, profile, output_format)
            return
        config = replace(
            config, tensor_parallel_size=tp_size_for(converted.plan.attn_tp_size, tp, directory)
        )
        check_layout_fits(converted.plan, kv_layout, directory)
    sized = size_for_workload(config, workload, directory)
    # NOTE: the profile computed above is the one LLM derives from the same settings
    with LLM(directory, sized.config) as llm:
        report = _generate(llm, workload, directory, sized.note)
    print_report(report, output_format)


def engine_config_from_options(
    options: dict[str, Any], *, kv_layout: str, tensor_parallel_size: int
) -> EngineConfig:
    """The engine settings ``run``'s flags name (KV_LAYOUT and the tensor-parallel size are
    decided beside the converted directory's record); the pool is sized for the workload
    later (``size_for_workload``).

    Raises:
        BadInputError: for --num-blocks with --kv-memory, or a --kv-memory that is no size.
    """
    from kvskill.runtime.engine_config import EngineConfig

    if options["num_blocks"] is not None and options["kv_memory"] is not None:
        raise BadInputError("give --num-blocks or --kv-memory, not both")
    kv_memory = options["kv_memory"]
    return EngineConfig(
        dtype=options["dtype"],
        # "auto" is EngineConfig's None: the best device present
        device=None if options["device"] == "auto" else options["device"],
        seed=options["seed"],
        random_weights=options["random_weights"],
        trust_remote_code=options["trust_remote_code"],
        block_size=options["block_size"],
        num_blocks=options["num_blocks"],
        kv_memory_bytes=None if kv_memory is None else parse_size(kv_memory),
        use_hybrid_blocks=kv_layout == "page_pool",
        log_layout=options["log_layout"],
        enable_prefix_caching=options["prefix_caching"],
        max_model_len=options["max_model_len"],
        max_num_batched_tokens=options["max_num_batched_tokens"],
        max_num_seqs=options["max_num_seqs"],
        tensor_parallel_size=tensor_parallel_size,
        tp_backend=options["tp_backend"],
        exact=options["exact"],
        prepack_linear=options["prepack_linear"],
        fuse_layers=options["fuse_layers"],
        screen_output_head=options["screen_output_head"],
        graph=options["graph"],
        speculative_tokens=options["speculative_tokens"],
        cpu_only_shapes=options["cpu_only_shapes"],
    )


def _generate(llm, workload: Workload, directory: Path, sizing_note: str | None) -> dict:
    """Run the workload's prompts to completion and return the report of the run."""
    from kvskill.runtime.ops import fla

    prompts = workload.prompts(vocab_size=llm.engine.vocab_size, max_model_len=llm.max_model_len)
    params = workload.sampling_params()
    progress = Progress(len(prompts) * params.max_tokens, enabled=sys.stderr.isatty())
    fla.reset_dispatch_report()
    started = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, on_step=progress.update)
    finally:
        progress.close()
    wall_s = time.perf_counter() - started
    return run_report(llm, outputs, wall_s=wall_s, directory=directory, sizing_note=sizing_note)


def tp_size_for(plan_tp: int, requested: int | None, directory: Path) -> int:
    """--tp, defaulting to the size the directory was converted for; the two must agree
    unless the conversion kept one rank's view (attn_tp_size 1), which any size can split."""
    if requested is None:
        return plan_tp
    if plan_tp not in (1, requested):
        raise BadInputError(
            f"{directory} was converted for attn_tp_size={plan_tp}; run it with --tp {plan_tp} "
            "(or convert with --attn-tp-size 1 to choose the size at run time)"
        )
    return requested
