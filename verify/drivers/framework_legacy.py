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

from pathlib import Path

import torch
from kvskill.implementer.record import ConvertedDir
from kvskill.verify.drivers.engine import EngineDriver
from kvskill.verify.drivers.framework_legacy_drive import drive_legacy, legacy_infer_config
from kvskill.verify.drivers.legacy_original import (
    finish_engine_report,
    import_model,
    legacy_original_dir,
    legacy_report,
    run_paged,
)
from kvskill.verify.options import VerifyOptions
from kvskill.verify.report import VerifyReport
from kvskill.verify.weights import condition_weights
from torch import nn


def is_framework_legacy(converted: ConvertedDir) -> bool:
    """Whether DIR holds a conversion of the framework's own Legacy model."""
    return bool(converted.plan.code.get("legacy_framework"))


def imports_the_framework(converted: ConvertedDir) -> bool:
    """Whether the Legacy original imports the framework's own packages (its config,
    parallel layers, fused MoE), which only a checkout answers (``legacy_checkout.py``)."""
    from kvskill.verify.drivers.checkout import framework_packages

    plan = converted.plan
    source_file = Path(plan.source.path) / plan.code["modeling_file"]
    return source_file.is_file() and bool(
        framework_packages(source_file.read_text(encoding="utf-8"))
    )


def verify_framework_legacy(converted: ConvertedDir, options: VerifyOptions) -> VerifyReport:
    """Run the Legacy original and the paged conversion on the same prompts and compare.

    Raises:
        BadInputError: the original's folder is gone, or an option this path does not take.
        UnsupportedModelError: the model imports framework modules the CPU host lacks.
    """
    from kvskill.runtime.executor_host import executor_infer_config, framework_modules
    from kvskill.runtime.ops.npu_standin import npu_standin

    plan, config = converted.plan, converted.config
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

        def build() -> nn.Module:
            converted_cls, converted_config, _ = import_model(
                converted.directory, plan.code, config
            )
            paged = converted_cls(
                converted_config, executor_infer_config(block_size=block_size), None
            ).eval()
            paged.load_state_dict(original.state_dict())
            return paged

        # NOTE: whole prompts per prefill step, as the Legacy original and the executor
        # (no chunked prefill at fbc225d) run them: a converted Legacy prefill starts each
        # request from a fresh state and refuses a step with tokens already cached
        driver = EngineDriver(seed=options.seed, use_hybrid_blocks=False, chunked_prefill=False)
        run = run_paged(report, build, driver, prompts, new_tokens)
    if run is None:
        return report
    note = f"Legacy rows allocated by the worker: {list(legacy.cache_shape)}"
    return finish_engine_report(report, prompts, legacy, run, note)
