"""``kvskill run`` on a standalone output: one static greedy batch through its own runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from kvskill.commands.run_workload import Workload
from kvskill.core.errors import BadInputError

if TYPE_CHECKING:
    from kvskill.runtime.engine_config import EngineConfig
    from kvskill.runtime.ops.reference.npu_profile import NpuProfile


def run_standalone(
    directory: Path,
    config: EngineConfig,
    workload: Workload,
    profile: NpuProfile,
    output_format: str,
) -> None:
    """One static greedy batch through the output's own runner."""
    from kvskill.runtime.ops import (
        check_run_block_size,
        profile_line,
        profile_report,
        use_npu_profile,
    )
    from kvskill.verify.launch import StandaloneRun, render_table

    if not workload.is_greedy:
        raise BadInputError(
            "the standalone runner decodes greedily; drop --temperature/--top-k/--top-p"
        )
    for flag in ("prepack_linear", "fuse_layers", "screen_output_head", "graph"):
        if getattr(config, flag):
            raise BadInputError(
                f"--{flag.replace('_', '-')} is a runtime option; a standalone output runs its "
                "own runner"
            )
    run = StandaloneRun.load(
        directory,
        dtype=config.dtype_name,
        device=config.device or "auto",
        seed=config.seed,
        random_weights=config.random_weights,
        trust_remote_code=config.trust_remote_code,
    )
    prompts = workload.prompts(vocab_size=run.vocab_size, max_model_len=run.max_model_len)
    if profile.shapes and run.record.kv_mode == "paged":  # the runner's own default too
        check_run_block_size(config.block_size or run.runner_module.BLOCK_SIZE)
    with use_npu_profile(profile):
        report = run.generate(
            prompts,
            max_new_tokens=workload.max_tokens,
            block_size=config.block_size,
            ignore_eos=workload.ignore_eos,
        )
    report["npu_limits"] = profile_report(profile, dtype=config.dtype_name, twin=False)
    if output_format == "json":
        click.echo(json.dumps(report))
    else:
        click.echo(render_table(report) + "\n" + profile_line(report["npu_limits"]))
