"""``verify`` of a framework-Legacy conversion: the converted model against its own Legacy
original, on a CPU.

The original is the framework's model as ``apply`` read it (``kvskill_plan.json`` names its
folder); it runs its Legacy path on rows allocated as the framework's worker does
(``framework_legacy_drive.py``). The converted model runs paged in the bundled runtime's
engine (continuous batching, shuffled free blocks, the three chains; ``engine.py``).
Both run inside the CPU ``torch_npu`` stand-in with the executor's imports answered by
kvskill's equal classes, on the same random weights and prompts; the comparison is verify's
(``compare_prompt``): greedy tokens identical and every step's logits within the tolerance.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.record import ConvertedDir
from kvskill.verify.compare import DEFAULT_ATOL, LOGIT_RTOL, compare_prompt
from kvskill.verify.drivers.engine import EngineDriver
from kvskill.verify.drivers.framework_legacy_drive import drive_legacy, legacy_infer_config
from kvskill.verify.options import VerifyOptions
from kvskill.verify.prompts import make_prompts
from kvskill.verify.report import Checked, VerifyReport
from kvskill.verify.weights import condition_weights
from torch import nn

#: prompt lengths, cycled: unequal, so the Legacy rows are right-padded differently
PROMPT_LENGTHS = (7, 3, 11, 5, 9, 2)
#: tokens per block when none is asked: several blocks per request, so block tables matter
CPU_BLOCK_SIZE = 16


def is_framework_legacy(converted: ConvertedDir) -> bool:
    """Whether DIR holds a conversion of the framework's own Legacy model."""
    return bool(converted.plan.code.get("legacy_framework"))


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


def verify_framework_legacy(converted: ConvertedDir, options: VerifyOptions) -> VerifyReport:
    """Run the Legacy original and the paged conversion on the same prompts and compare.

    Raises:
        BadInputError: the original's folder is gone, or an option this path does not take.
        UnsupportedModelError: the model imports framework modules the CPU host lacks.
    """
    from kvskill.runtime.executor_host import executor_infer_config, framework_modules
    from kvskill.runtime.ops.npu_standin import npu_standin
    from kvskill.verify.drivers.checkout import framework_packages

    plan, config = converted.plan, converted.config
    source_file = Path(plan.source.path) / plan.code["modeling_file"]
    if source_file.is_file() and framework_packages(source_file.read_text(encoding="utf-8")):
        # the rest of the framework (its config, parallel layers, fused MoE) comes from the
        # user's checkout
        from kvskill.verify.drivers.legacy_checkout import verify_against_checkout

        return verify_against_checkout(converted, options)
    original_dir = legacy_original_dir(converted, options, "framework-Legacy")
    report, prompts = legacy_report(converted, options)
    lengths, block_size = [len(p) for p in prompts], report.block_size
    new_tokens = options.max_new_tokens
    report.notes.append(
        f"reference: the Legacy original {original_dir.name}/{plan.code['modeling_file']} on "
        "rows allocated as the framework's worker does (one static batch), CPU torch_npu "
        "stand-in; whole-prompt prefill steps, as the executor runs them; NPU shape limits "
        "not checked on this path"
    )
    with npu_standin(), framework_modules(), torch.no_grad():
        legacy_config = legacy_infer_config(
            batch_size=len(prompts), input_truncated_len=max(lengths), max_new_tokens=new_tokens
        )
        original_cls, original_config, original_module = import_model(
            original_dir, plan.code, config
        )
        original: nn.Module = original_cls(original_config, legacy_config, None).eval()
        condition_weights(original, options.seed)
        legacy = drive_legacy(
            original,
            prompts,
            max_new_tokens=new_tokens,
            infer_config=legacy_config,
            metadata_cls=original_module.ForwardMetaData,
            seed=options.seed,
        )
        converted_cls, converted_config, _ = import_model(converted.directory, plan.code, config)
        paged = converted_cls(
            converted_config, executor_infer_config(block_size=block_size), None
        ).eval()
        paged.load_state_dict(original.state_dict())
        try:
            # NOTE: whole prompts per prefill step, as the Legacy original and the executor
            # (no chunked prefill at fbc225d) run them: a converted Legacy prefill starts each
            # request from a fresh state and refuses a step with tokens already cached
            driver = EngineDriver(seed=options.seed, use_hybrid_blocks=False, chunked_prefill=False)
            run = driver.run(paged, prompts, max_new_tokens=new_tokens, block_size=block_size)
        except Exception as exc:  # the converted code is what is being checked
            report.error = f"the converted model failed in the runtime: {type(exc).__name__}: {exc}"
            return report
    report.notes.append(f"Legacy rows allocated by the worker: {list(legacy.cache_shape)}")
    compare_legacy_prompts(report, prompts, legacy, run)
    report.chains = [chain.to_dict() for chain in run.chains]
    return report
