"""``apply --mode standalone``: analyze, convert the modeling file, render the runner, write.

The output directory holds what framework mode writes (the converted modeling file,
``config.json``, ``kvskill_plan.json``, extra Python files and linked weights) plus
``runner_<model>.py``. The conversion record in ``kvskill_plan.json`` names the runner and the
KV mode, so ``verify`` and ``run`` know to drive the runner instead of the bundled engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvskill.analyzer import Plan, analyze_model
from kvskill.core.errors import BadInputError
from kvskill.implementer.standalone.pipeline import convert_standalone_source
from kvskill.implementer.standalone.runner import RenderedRunner, render_runner
from kvskill.implementer.standalone.spec import KvMode, StandaloneSpec
from kvskill.implementer.writer import (
    PLAN_FILE,
    ApplyOptions,
    ApplyResult,
    OutputFiles,
    check_out_dir,
    check_out_vs_model,
    config_json,
    dump_json,
    modeling_diff,
    plan_json,
    read_source,
    sign_conversion,
    source_package,
)

#: key of the standalone record inside kvskill_plan.json's "conversion" block
STANDALONE_KEY = "standalone"


@dataclass(frozen=True, kw_only=True)
class StandaloneOptions:
    """The standalone-only flags of ``kvskill apply``."""

    kv_mode: str = KvMode.PAGED.value
    mla_absorb: str = "auto"


@dataclass(frozen=True, kw_only=True)
class StandaloneConversion:
    plan: Plan
    spec: StandaloneSpec
    original: str
    converted: str
    runner: RenderedRunner


def convert_standalone_model(
    model: str, options: ApplyOptions, standalone: StandaloneOptions
) -> StandaloneConversion:
    """Analyze MODEL for standalone deployment; convert its modeling file; render the runner."""
    plan = analyze_model(
        model,
        deploy_mode="standalone",
        config_overrides=options.config_overrides or None,
        attn_tp_size=options.attn_tp_size,
        block_size=options.block_size,
    )
    spec = StandaloneSpec.from_plan(
        plan,
        kv_mode=standalone.kv_mode,
        mla_absorb=standalone.mla_absorb,
        fa_version=options.fa_version,
        block_size=options.block_size,
    )
    modeling_file = Path(plan.source["modeling_file"])
    original = read_source(modeling_file)
    converted = convert_standalone_source(
        original, spec, package=source_package(plan), filename=modeling_file.name
    )
    if spec.kv_mode is KvMode.CONTIGUOUS:
        # what the written code does: the Legacy layout, chosen by the user
        plan = dataclasses.replace(
            plan,
            kv_mode="legacy",
            legacy_reason="requested with --kv-mode contiguous (standalone mode 1)",
            input_layout=spec.input_layout,
        )
    return StandaloneConversion(
        plan=plan,
        spec=spec,
        original=original,
        converted=converted,
        runner=render_runner(plan, spec),
    )


def standalone_record(conversion: StandaloneConversion) -> dict[str, Any]:
    """What ``verify``/``run`` need to drive the runner (stored in kvskill_plan.json)."""
    spec = conversion.spec
    return {
        "runner": conversion.runner.file_name,
        "kv_mode": spec.kv_mode.value,
        "mode": spec.mode_number,
        "mla_absorb": spec.mla,
        "input_layout": spec.input_layout,
        "block_size": spec.block_size,
    }


def apply_standalone(
    model: str, out_dir: Path | None, options: ApplyOptions, standalone: StandaloneOptions
) -> ApplyResult:
    """Convert MODEL for standalone deployment and write it (or only diff it with dry_run).

    Raises:
        BadInputError: bad MODEL or flags, unreadable files, a non-empty ``out_dir``.
        UnsupportedModelError: the model cannot run in this KV mode; nothing is written.
    """
    if out_dir is None and not options.dry_run:
        raise BadInputError("--out DIR is required (or pass --dry-run to see the diff)")
    if out_dir is not None and not options.dry_run:
        check_out_vs_model(out_dir, model)
    conversion = convert_standalone_model(model, options, standalone)
    plan = conversion.plan
    name = Path(plan.source["modeling_file"]).name
    plan_data = plan_json(plan, conversion.original, conversion.converted, options)
    plan_data["conversion"]["mode"] = "standalone"
    plan_data["conversion"][STANDALONE_KEY] = standalone_record(conversion)
    sign_conversion(
        plan_data,
        plan,
        {name: conversion.converted, conversion.runner.file_name: conversion.runner.text},
    )
    texts = {
        name: conversion.converted,
        conversion.runner.file_name: conversion.runner.text,
        "config.json": dump_json(config_json(plan)),
        PLAN_FILE: dump_json(plan_data),
    }
    output = OutputFiles.collect(plan, name, texts, copy_weights=options.copy_weights)
    if out_dir is not None:
        check_out_dir(out_dir, plan, options.force)
    if not options.dry_run:
        assert out_dir is not None
        output.write(out_dir)
    return ApplyResult(
        plan=plan,
        out_dir=out_dir,
        modeling_file=name,
        files=output.report(),
        diff=modeling_diff(name, conversion.original, conversion.converted),
        changed=conversion.converted != conversion.original,
    )
