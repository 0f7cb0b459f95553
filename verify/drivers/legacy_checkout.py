"""``verify`` of a framework-Legacy conversion whose model imports the framework itself
(``executor.core.config``, ``module.*``: the framework's Qwen3.5), against the user's checkout.

Both models are built as the framework's worker builds them: the checkout's
``InferenceConfig`` (one eager rank, a static batch of one row per prompt) and
``CommManager`` (``checkout.one_rank_comm``: a one-rank gloo world group), under the
checkout's ``set_default_torch_dtype``. The Legacy original then runs its own path
(``framework_legacy_drive``); the converted one, whose cache classes and step metadata kvskill
answers (``kvskill_answers_cache_and_metadata``), runs paged in the bundled runtime's engine.

The batch: a Legacy decode step runs every row of the static batch (Qwen3.5's gated delta
asserts ``batch_size == decode_batch_size``), so both models are built for as many rows as
there are prompts, and the engine prefills all prompts in one step; equal ``max_new_tokens``
keep every request in every decode step. The comparison is verify's (``compare_prompt``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.record import ConvertedDir
from kvskill.runtime.ops.reference import OpInputError, ReferenceUnsupportedError
from kvskill.verify.drivers.checkout import (
    after_loading,
    build_settings,
    find_checkout,
    framework_packages,
    is_checkout,
    kvskill_answers_cache_and_metadata,
    one_rank_comm,
    one_rank_process_group,
    random_weights,
)
from kvskill.verify.drivers.engine import MAX_BATCHED_TOKENS, EngineDriver
from kvskill.verify.drivers.framework_legacy_drive import drive_legacy
from kvskill.verify.drivers.legacy_original import (
    finish_engine_report,
    import_model,
    legacy_original_dir,
    legacy_report,
    run_paged,
)
from kvskill.verify.options import VerifyOptions
from kvskill.verify.report import VerifyReport
from torch import nn


def checkout_for(original_dir: Path, modeling_file: str) -> Path:
    """The checkout the model's framework imports come from.

    Raises:
        UnsupportedModelError: no checkout is named or found above the model folder.
    """
    needs = framework_packages((original_dir / modeling_file).read_text(encoding="utf-8"))
    root = find_checkout(original_dir)
    if root is None or not is_checkout(root):
        shown = ", ".join(repr(name) for name in needs[:3])
        raise UnsupportedModelError(
            f"verify cannot build {original_dir.name}/{modeling_file} on the CPU host: it "
            f"imports {shown}, which only a cann-recipes-infer checkout answers (kvskill "
            "answers executor.core.kv_cache and executor.utils.forward_metadata); set "
            "KVSKILL_CANN_RECIPES to one"
        )
    return root


def verify_against_checkout(converted: ConvertedDir, options: VerifyOptions) -> VerifyReport:
    """Run the Legacy original and the paged conversion on the same prompts and compare.

    Raises:
        BadInputError: the original's folder is gone, or an option this path does not take.
        UnsupportedModelError: no checkout to import the framework from.
    """
    from kvskill.runtime.ops.npu_standin import npu_standin

    plan, config = converted.plan, converted.config
    # NOTE: bfloat16 is what the framework runs; the operators of its MoE dispatch take
    # float16 / bfloat16 only, so a float32 run of such a model refuses there, by name
    original_dir = legacy_original_dir(
        converted, options, "framework-Legacy", dtypes=("float32", "bfloat16")
    )
    root = checkout_for(original_dir, plan.code["modeling_file"])
    report, prompts = legacy_report(converted, options)
    lengths, block_size = [len(p) for p in prompts], report.block_size
    new_tokens, dtype = options.max_new_tokens, getattr(torch, options.dtype)
    settings = build_settings(
        batch_size=len(prompts), input_truncated_len=max(lengths), max_new_tokens=new_tokens
    )
    report.notes.append(
        f"reference: the Legacy original {original_dir.name}/{plan.code['modeling_file']} with "
        f"the framework imported from {root}, on rows allocated by its own init_cache (one "
        f"static batch of {len(prompts)} rows), CPU torch_npu stand-in, one-rank gloo group; "
        "whole-prompt prefill steps; NPU shape limits not checked on this path"
    )
    with npu_standin(framework_root=root), one_rank_process_group(), torch.no_grad():
        framework_config = importlib.import_module("executor.core.config")
        loader_utils = importlib.import_module("executor.model_loader.utils")

        comms = []

        def build(cls, model_config, scheduler: dict) -> tuple[nn.Module, object]:
            scheduler = {**settings["scheduler_config"], **scheduler}
            infer_config = framework_config.InferenceConfig.from_dict(
                {**settings, "scheduler_config": scheduler}, global_rank=0, local_rank=0
            )
            comms.append(one_rank_comm(framework_config.CommManager, infer_config.parallel_config))
            # verify's dtype is the model's: its init_cache allocates in config.torch_dtype
            model_config.torch_dtype = model_config.dtype = dtype
            torch.manual_seed(options.seed)  # what __init__ draws (A_log) is reproducible
            with loader_utils.set_default_torch_dtype(dtype):
                return cls(model_config, infer_config, comms[-1]).eval(), infer_config

        original_cls, original_config, original_module = import_model(
            original_dir, plan.code, config
        )
        try:
            original, legacy_config = build(original_cls, original_config, {})
            random_weights(original, options.seed)
            weights = {k: v.clone() for k, v in original.state_dict().items()}
            after_loading(original)
            legacy = drive_legacy(
                original,
                prompts,
                max_new_tokens=new_tokens,
                infer_config=legacy_config,
                metadata_cls=original_module.ForwardMetaData,
                seed=options.seed,
            )
        except (ReferenceUnsupportedError, OpInputError) as exc:
            # an operator the stand-in refuses by name, or a documented limit of one
            raise UnsupportedModelError(
                f"the Legacy original {original_dir.name}/{plan.code['modeling_file']} does not "
                f"run on the CPU stand-in in {options.dtype}: {exc}"
            ) from exc

        def build_paged() -> nn.Module:
            with kvskill_answers_cache_and_metadata():
                converted_cls, converted_config, _ = import_model(
                    converted.directory, plan.code, config
                )
            paged, _ = build(converted_cls, converted_config, {"block_size": block_size})
            paged.load_state_dict(weights)
            after_loading(paged)
            return paged

        driver = EngineDriver(
            seed=options.seed,
            use_hybrid_blocks=False,
            chunked_prefill=False,
            max_batched_tokens=max(MAX_BATCHED_TOKENS, sum(lengths)),
        )
        run = run_paged(report, build_paged, driver, prompts, new_tokens)
    if run is None:
        return report
    answered = sorted(set().union(*(comm.answered_groups for comm in comms)))
    note = (
        f"Legacy rows allocated by init_cache: {list(legacy.cache_shape)}; groups read but "
        f"registered only above one rank, answered as the one rank: {answered or 'none'}"
    )
    return finish_engine_report(report, prompts, legacy, run, note)
