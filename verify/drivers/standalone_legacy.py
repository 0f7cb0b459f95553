"""``verify`` of a standalone-Legacy conversion: mode 2 against its own mode 1 original, on a CPU.

The original is the framework's standalone model as ``apply`` read it (``kvskill_plan.json``
names its folder): its Legacy rows from ``init_cache``. The converted model runs paged. Both
are driven by the runner's own protocol (``standalone_legacy_drive.py``) inside the CPU
``torch_npu`` stand-in, on the same random weights and right-padded prompts; the comparison is
verify's (``compare_prompt``): greedy tokens identical, every step's logits within tolerance.

The converted run also proves the three chains a runner-owned paged cache has:

1. init: every cache ``init_cache`` returns is ``[total_blocks, block_size, width]`` with
   ``total_blocks`` the static block table's size; the table is then shuffled (any one-to-one
   table is valid), so a kernel that ignored it would read the wrong blocks;
2. runtime: every step's metadata has a block table and one slot per token, and decode step k
   attends over prompt length + k keys (the first decode step: prompt length + 1);
3. release: a second generate on the same, now dirty caches with the prompts in reverse row
   order gives the same tokens per prompt.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from kvskill.analyzer.plan import MlaDims
from kvskill.core.errors import BadInputError
from kvskill.implementer.mla.spec import check_mla_block_size
from kvskill.implementer.record import ConvertedDir
from kvskill.runtime.chains import ChainResult, chain_result
from kvskill.verify.drivers.checkout import after_loading, framework_packages, random_weights
from kvskill.verify.drivers.legacy_original import (
    compare_legacy_prompts,
    import_model,
    legacy_original_dir,
    legacy_report,
)
from kvskill.verify.drivers.standalone_legacy_drive import drive_runner_protocol
from kvskill.verify.options import VerifyOptions
from kvskill.verify.reference.original_failure import original_failure
from kvskill.verify.report import VerifyReport
from torch import nn

#: tokens per block when none is asked: several blocks per row, so the block table matters
CPU_BLOCK_SIZE = 8
#: the same for MLA, whose fused attention takes blocks of a multiple of 16 (npu_ops §1.8)
CPU_MLA_BLOCK_SIZE = 16


def is_standalone_legacy(converted: ConvertedDir) -> bool:
    """Whether DIR holds a conversion of the framework's standalone Legacy model."""
    return bool(converted.plan.code.get("legacy_standalone"))


def runner_settings(*, batch_size: int, input_max_len: int, max_new_tokens: int) -> dict[str, Any]:
    """The runner settings a framework standalone model reads (its YAML after the runner's
    ``update_vars``), for one process without parallelism."""
    return {
        "world_size": 1,
        "exe_mode": "eager",
        "model_config": {
            "with_ckpt": False,
            "enable_weight_nz": False,
            "perfect_eplb": False,
            "mm_quant_mode": "A16W16",
            "gmm_quant_mode": "A16W16",
        },
        "data_config": {
            "batch_size": batch_size,
            "batch_size_per_rank": batch_size,
            "input_max_len": input_max_len,
            "max_new_tokens": max_new_tokens,
        },
        "parallel_config": {
            "attn_tp_size": 1,
            "attn_dp_size": 1,
            "moe_tp_size": 1,
            "moe_ep_size": 1,
            "embed_tp_size": 1,
            "embed_dp_size": 1,
            "lmhead_tp_size": 1,
        },
    }


class _PagedChains:
    """Hooks of the converted run that collect the init and runtime chains' evidence."""

    def __init__(self, seed: int, get_forward_metadata, *, mla: MlaDims | None) -> None:
        self.seed = seed
        #: MLA: each layer's two caches are the latent (nope) and the rope keys, one head of
        #: kv_lora_rank and qk_rope_head_dim each (the executor's nope_cache / rope_cache)
        self.mla = mla
        #: the metadata getter the converted file imported (the executor's or kvskill's)
        self.get_forward_metadata = get_forward_metadata
        self.init_failures: list[str] = []
        self.caches = 0

    def after_init(self, model: nn.Module, past_key_values: Any) -> None:
        table = getattr(model, "block_table", None)
        if not isinstance(table, torch.Tensor):
            self.init_failures.append("init_cache built no block_table on the model")
            return
        blocks = (table.numel(), model.block_size)
        # [blocks, block_size, width]; MLA: [blocks, block_size, 1, dim]
        expected: dict[str, tuple[int, ...] | None] = (
            {
                "nope": (*blocks, 1, self.mla.kv_lora_rank),
                "rope": (*blocks, 1, self.mla.qk_rope_head_dim),
            }
            if self.mla is not None
            else {"key": None, "value": None}
        )
        for index, layer in enumerate(past_key_values):
            for (name, shape), cache in zip(expected.items(), layer, strict=True):
                self.caches += 1
                found = tuple(cache.shape)
                if (shape is not None and found != shape) or (
                    shape is None and (cache.dim() != 3 or found[:2] != blocks)
                ):
                    self.init_failures.append(
                        f"layer {index} {name} cache {found}, expected "
                        f"{list(shape) if shape else [*blocks, 'width']}"
                    )
        # any one-to-one table is valid for a static allocation: shuffle it, so a kernel or a
        # slot formula that assumed arange reads and writes the wrong blocks
        generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(table.numel(), generator=generator).to(table.device, table.dtype)
        model.block_table = order.view_as(table)

    def on_step(self, inputs: dict[str, Any]) -> dict[str, Any]:
        md = self.get_forward_metadata()
        return {
            "is_prefill": bool(inputs["is_prefill"]),
            "tokens": int(inputs["input_ids"].numel()),
            "tables": sorted(md.block_table or {}),
            "slots": {k: int(v.numel()) for k, v in (md.slot_mapping or {}).items()},
            "kv": md.actual_seq_lengths_kv.tolist()
            if md.actual_seq_lengths_kv is not None
            else None,
        }


def _runtime_chain(steps: list[dict[str, Any]], lengths: list[int]) -> ChainResult:
    failures = []
    for index, step in enumerate(steps):
        kind = "prefill" if index == 0 else f"decode step {index}"
        if step["tables"] != ["FullAttention"]:
            failures.append(f"{kind}: block tables {step['tables']}, expected ['FullAttention']")
        if step["slots"] != {"FullAttention": step["tokens"]}:
            failures.append(f"{kind}: slot_mapping {step['slots']} for {step['tokens']} tokens")
        expected = [n + index for n in lengths]
        if index and step["kv"] != expected:
            failures.append(
                f"{kind}: actual_seq_lengths_kv {step['kv']}, expected {expected} "
                "(prompt + generated)"
            )
    if len(steps) < 2:
        failures.append(f"{len(steps)} steps recorded; expected a prefill and decode steps")
    return chain_result(
        "runtime",
        f"{len(steps)} steps: block table and one slot per token; decode kv = prompt + generated",
        failures,
    )


@contextmanager
def _framework_imports(framework_root: Path | None):
    """The framework's imports answered by kvskill's equal classes, or, given a checkout, by
    the checkout itself (its ``executor`` and ``module`` packages), inside the stand-in."""
    from kvskill.runtime.executor_host import framework_modules
    from kvskill.runtime.ops.npu_standin import npu_standin

    if framework_root is not None:
        with npu_standin(framework_root=framework_root):
            yield
        return
    with npu_standin(), framework_modules():
        yield


def verify_standalone_legacy(
    converted: ConvertedDir, options: VerifyOptions, *, framework_root: Path | None = None
) -> VerifyReport:
    """Run the Legacy original and the mode 2 conversion on the same prompts and compare.

    Args:
        framework_root: a cann-recipes-infer checkout whose ``executor`` / ``module``
            packages the model imports (the framework's real files); None answers the
            executor's metadata module with kvskill's.

    Raises:
        BadInputError: the original's folder is gone, or an option this path does not take.
    """

    plan, config = converted.plan, converted.config
    original_dir = legacy_original_dir(converted, options, "standalone-Legacy")
    needs = framework_packages((original_dir / plan.code["modeling_file"]).read_text("utf-8"))
    if needs and framework_root is None:
        raise BadInputError(
            f"{plan.code['modeling_file']} imports the framework's own packages "
            f"({', '.join(needs[:3])}); set KVSKILL_CANN_RECIPES to a cann-recipes-infer "
            "checkout to verify it"
        )
    if not needs:
        framework_root = None  # kvskill answers the executor's metadata module itself
    block_size = CPU_MLA_BLOCK_SIZE if plan.is_mla else CPU_BLOCK_SIZE
    if plan.is_mla:
        check_mla_block_size(options.block_size)
    report, prompts = legacy_report(converted, options, block_size)
    lengths, block_size = [len(p) for p in prompts], report.block_size
    new_tokens = options.max_new_tokens
    pad = int(config.get("pad_token_id") or 0)
    report.notes.append(
        f"reference: the Legacy original {original_dir.name}/{plan.code['modeling_file']} on "
        "the rows its own init_cache allocates (standalone mode 1), driven as its runner does "
        "(one right-padded static batch), CPU torch_npu stand-in; NPU shape limits not checked"
    )
    settings = runner_settings(
        batch_size=len(prompts), input_max_len=max(lengths), max_new_tokens=new_tokens
    )
    drive = {"max_new_tokens": new_tokens, "pad_token_id": pad, "seed": options.seed}
    with _framework_imports(framework_root), torch.no_grad():
        original_cls, original_config, _ = import_model(original_dir, plan.code, config)
        # NOTE: condition_weights sets the projections; the rest (biases) keeps its default
        # init, seeded here so that a report is reproducible
        torch.manual_seed(options.seed)
        try:
            # verify runs float32: a layer the model builds in its own dtype (the framework's
            # bf16 embedding) is cast with the rest
            original: nn.Module = original_cls(original_config, settings).eval().float()
        except Exception as exc:  # the model's own code, under this transformers
            raise original_failure(
                converted, exc, stage="build", shrunk=False, workdir=converted.directory
            ) from exc
        random_weights(original, options.seed)
        weights = {k: v.clone() for k, v in original.state_dict().items()}
        after_loading(original)
        try:
            legacy = drive_runner_protocol(original, prompts, **drive)
        except Exception as exc:
            raise original_failure(
                converted, exc, stage="generate", shrunk=False, workdir=converted.directory
            ) from exc
        metadata_module = None
        try:  # the converted code is what is being checked, from its import on
            converted_cls, converted_config, module = import_model(
                converted.directory, plan.code, config
            )
            paged = converted_cls(converted_config, settings).eval().float()
            paged.load_state_dict(weights)
            after_loading(paged)
            paged.block_size = block_size
            chains = _PagedChains(
                options.seed, module.get_forward_metadata, mla=plan.mla if plan.is_mla else None
            )
            metadata_module = sys.modules[module.get_forward_metadata.__module__]
            run = drive_runner_protocol(
                paged, prompts, after_init=chains.after_init, on_step=chains.on_step, **drive
            )
            again = drive_runner_protocol(
                paged, prompts[::-1], past_key_values=run.past_key_values, **drive
            )
        except Exception as exc:
            report.error = f"the converted model failed in its runner: {type(exc).__name__}: {exc}"
            return report
        finally:
            if metadata_module is not None:
                metadata_module.reset_forward_metadata()
    shape = tuple(legacy.past_key_values[0][0].shape)
    report.notes.append(
        f"Legacy rows from init_cache: {list(shape)}; paged block size {block_size}"
    )
    compare_legacy_prompts(report, prompts, legacy, run)
    release = [
        f"prompt {i}: {a} on the reused caches, {b} on fresh ones"
        for i, (a, b) in enumerate(zip(again.token_ids[::-1], run.token_ids, strict=True))
        if a != b
    ]
    report.chains = [
        chain.to_dict()
        for chain in (
            chain_result(
                "init",
                f"{chains.caches} caches from init_cache are paged blocks; block table shuffled",
                chains.init_failures,
            ),
            _runtime_chain(run.steps, lengths),
            chain_result(
                "release", "rerun on the dirty caches, rows reversed: same tokens", release
            ),
        )
    ]
    return report


__all__ = ["is_standalone_legacy", "runner_settings", "verify_standalone_legacy"]
