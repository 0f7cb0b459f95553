"""The Legacy original a framework-Legacy or standalone-Legacy conversion is verified
against: where it lives, how its modeling file is imported, the prompts and empty report
of such a verify, the comparison of both models' tokens and logits, and the paged run of
the converted model in the bundled runtime's engine that the framework-Legacy flows share.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.record import ConvertedDir
from kvskill.verify.compare import DEFAULT_ATOL, LOGIT_RTOL, compare_prompt
from kvskill.verify.drivers.base import DriverRun
from kvskill.verify.drivers.engine import EngineDriver
from kvskill.verify.options import VerifyOptions
from kvskill.verify.prompts import make_prompts
from kvskill.verify.report import Checked, VerifyReport
from torch import nn

#: prompt lengths, cycled: unequal, so the Legacy rows are right-padded differently
PROMPT_LENGTHS = (7, 3, 11, 5, 9, 2)
#: tokens per block when none is asked: several blocks per request, so block tables matter
CPU_BLOCK_SIZE = 16


def import_model(model_dir: Path, code: dict[str, Any], config: dict[str, Any]):
    """(model class, config object) of MODEL_DIR's modeling file (inside the stand-in)."""
    from kvskill.runtime.loader import import_model_package

    package = import_model_package(model_dir)
    try:
        module = importlib.import_module(f"{package}.{Path(code['modeling_file']).stem}")
    except ModuleNotFoundError as exc:
        # NOTE: the CPU host answers the executor's cache and metadata modules only; a model
        # importing the rest of the framework (its config, parallel layers, fused MoE) runs
        # against a real checkout (make test-cann-recipes), not here
        raise UnsupportedModelError(
            f"verify cannot build {model_dir.name}/{code['modeling_file']} on the CPU host: it "
            f"imports {exc.name!r}, and the host provides executor.core.kv_cache and "
            "executor.utils.forward_metadata only"
        ) from exc
    target = config.get("auto_map", {}).get("AutoConfig")
    if isinstance(target, str) and "." in target:
        config_module, config_class = target.rsplit(".", 1)
        config_cls = getattr(importlib.import_module(f"{package}.{config_module}"), config_class)
    else:
        from transformers import PretrainedConfig as config_cls
    settings = {k: v for k, v in config.items() if k not in ("auto_map", "model_type")}
    return getattr(module, code["causal_lm_class"]), config_cls(**settings), module


def legacy_original_dir(
    converted: ConvertedDir,
    options: VerifyOptions,
    kind: str,
    dtypes: tuple[str, ...] = ("float32",),
) -> Path:
    """The folder of the Legacy original a KIND conversion is verified against.

    Raises:
        BadInputError: an option these paths do not take, or the original is gone.
    """
    if options.dtype not in dtypes or options.kv_layout != "contiguous":
        raise BadInputError(
            f"verify of a {kind} conversion runs {' or '.join(dtypes)} on the contiguous "
            "layout only"
        )
    plan = converted.plan
    original_dir = Path(plan.source.path)
    if not (original_dir / plan.code["modeling_file"]).is_file():
        raise BadInputError(
            f"the Legacy original {original_dir / plan.code['modeling_file']} is gone; "
            "verify compares against it"
        )
    return original_dir


def compare_legacy_prompts(report: VerifyReport, prompts, legacy, run) -> None:
    """Add verify's comparison of every prompt to REPORT: the Legacy original's greedy tokens
    and logits (LEGACY) against the paged run's (RUN), at the report's tolerance."""
    for index, prompt in enumerate(prompts):
        report.prompts.append(
            compare_prompt(
                index,
                prompt,
                legacy.token_ids[index],
                torch.stack(legacy.logits[index]),
                run.token_ids[index],
                run.logits[index],
                report.atol,
            )
        )


def legacy_report(
    converted: ConvertedDir, options: VerifyOptions, default_block_size: int = CPU_BLOCK_SIZE
) -> tuple[VerifyReport, list[list[int]]]:
    """The empty report of a Legacy-original verify (random weights, never shrunk) and its
    prompts: unequal lengths cycled from PROMPT_LENGTHS, so the Legacy rows pad differently."""
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(options.num_prompts)]
    prompts = make_prompts(lengths, int(converted.config["vocab_size"]), options.seed)
    report = VerifyReport(
        model_type=converted.plan.model_type,
        directory=str(converted.directory),
        shrunk=False,
        checked=Checked.RANDOM_WEIGHTS,
        config_changes={},
        dtype=options.dtype,
        atol=options.atol if options.atol is not None else DEFAULT_ATOL[options.dtype],
        rtol=options.rtol if options.rtol is not None else LOGIT_RTOL,
        block_size=options.block_size or default_block_size,
    )
    return report, prompts


def run_paged(
    report: VerifyReport,
    build: Callable[[], nn.Module],
    driver: EngineDriver,
    prompts: list[list[int]],
    max_new_tokens: int,
) -> DriverRun | None:
    """The converted model, built by BUILD, run paged by DRIVER at the report's block size;
    None when it fails, with the failure in REPORT.error (the converted code is what is
    being checked, from its import on)."""
    try:
        return driver.run(
            build(), prompts, max_new_tokens=max_new_tokens, block_size=report.block_size
        )
    except Exception as exc:
        report.error = f"the converted model failed in the runtime: {type(exc).__name__}: {exc}"
        return None


def finish_engine_report(
    report: VerifyReport, prompts: list[list[int]], legacy, run: DriverRun, note: str
) -> VerifyReport:
    """REPORT with NOTE, every prompt compared, and the engine run's three chains."""
    report.notes.append(note)
    compare_legacy_prompts(report, prompts, legacy, run)
    report.chains = [chain.to_dict() for chain in run.chains]
    return report
