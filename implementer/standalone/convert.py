"""The standalone conversion: the modeling file rewritten for a runner-owned cache, plus the
runner ``runner_<model>.py`` rendered for it (``str -> str``; ``writer.py`` writes both).

The conversion record names the runner and the KV mode, so ``verify`` and ``run`` drive the
runner instead of the bundled engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvskill.analyzer import Plan
from kvskill.analyzer.plan import KvMode as PlanKvMode
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions, Conversion, read_source, source_package
from kvskill.implementer.kv_mode import resolve_kv_mode
from kvskill.implementer.pipeline import convert
from kvskill.implementer.record import StandaloneRecord
from kvskill.implementer.standalone.own_legacy import convert_standalone_own_legacy
from kvskill.implementer.standalone.runner import render_runner, takes_logits_to_keep
from kvskill.implementer.standalone.spec import KvMode, StandaloneSpec


def convert_standalone_source(
    source: str,
    spec: StandaloneSpec,
    *,
    package: str | None = None,
    filename: str = "<modeling file>",
) -> str:
    """The standalone conversion of one modeling file (``str -> str``, no I/O).

    Modes 2 and 3 emit exactly the framework rewrite's modeling code (the layer reads
    ``slot_mapping``/``block_table`` from the forward metadata whoever builds it, so the
    generated runner plays the framework's part); mode 1 takes the contiguous path.
    """
    return convert(source, spec.base, spec.conversion_path, package=package, filename=filename)


def convert_standalone(plan: Plan, options: ApplyOptions) -> Conversion:
    """Convert a standalone-mode Plan's modeling file and render its runner.

    Raises:
        UnsupportedModelError: the Plan shares one cache across layers (cross-layer KV
            sharing), which only the framework runtime's get_cache_info() wires.
    """
    if plan.code.get("legacy_standalone"):
        # the framework's own standalone model: its runner stays, its mode 1 rows become mode 2
        return convert_standalone_own_legacy(plan, options)
    if plan.compressed_attention is not None:
        raise UnsupportedModelError(
            f"{Path(plan.source.modeling_file).name}: cannot convert in standalone mode: "
            "compressed attention (DeepSeek-V4) is rewritten for framework mode only (its "
            "compressor state and compressed rows need the runtime's SlidingWindow and "
            "compressed groups, which the standalone runner does not build): use --mode framework"
        )
    sharing = plan.code.get("kv_sharing") or {}
    if sharing.get("shared"):
        raise UnsupportedModelError(
            f"{Path(plan.source.modeling_file).name}:{sharing['line']}: layers reuse another "
            f"layer's keys and values (`{sharing['reads_shared_when']}`); the standalone runner "
            "allocates one cache per layer and cannot share one: use --mode framework"
        )
    spec = StandaloneSpec.from_plan(
        plan,
        kv_mode=resolve_kv_mode(plan, options.kv_mode),
        mla_absorb=options.mla_absorb,
        fa_version=options.fa_version,
        block_size=options.block_size,
    )
    modeling_file = Path(plan.source.modeling_file)
    original = read_source(modeling_file)
    converted = convert_standalone_source(
        original, spec, package=source_package(plan), filename=modeling_file.name
    )
    if spec.kv_mode is KvMode.CONTIGUOUS and not spec.legacy:
        # what the written code does: the Legacy layout, chosen by the user
        plan = dataclasses.replace(
            plan,
            kv_mode=PlanKvMode.LEGACY,
            legacy_reason="requested with --kv-mode contiguous (standalone mode 1)",
            input_layout=spec.input_layout,
        )
    runner = render_runner(
        plan, spec, keeps_logit_rows=takes_logits_to_keep(converted, plan.architecture)
    )
    record = StandaloneRecord(
        runner=runner.file_name,
        kv_mode=spec.record_kv_mode,
        mode=spec.mode_number,
        mla_absorb=spec.mla,
        input_layout=str(spec.input_layout),
        block_size=spec.block_size,
    )
    return Conversion(
        plan=plan,
        original=original,
        converted=converted,
        added={runner.file_name: runner.text},
        standalone=record,
    )
