"""The framework's own standalone Legacy model (mode 1) converted in place to mode 2.

Unlike the other standalone conversions, no runner is generated: the model directory has its
own (``runner_*.py``), which asks the model for its caches and each step's inputs. The
rewrite (KVR024, KVR025) changes what the model answers; the runner files are written to the
output unchanged, so the converted directory runs as the original did.
"""

from __future__ import annotations

from pathlib import Path

from kvskill.analyzer import Plan
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions, Conversion, read_source
from kvskill.implementer.pipeline import convert_standalone_legacy_source
from kvskill.implementer.record import StandaloneRecord
from kvskill.implementer.spec import ConversionSpec


def convert_standalone_own_legacy(plan: Plan, options: ApplyOptions) -> Conversion:
    """Convert the standalone Legacy model of PLAN to mode 2, keeping its runner.

    Raises:
        UnsupportedModelError: MLA (mode 3 over the framework's nope / rope rows is not
            converted yet), a --kv-mode other than paged, or a structure the rewrite refuses.
    """
    modeling_file = Path(plan.source.modeling_file)
    if plan.is_mla:
        raise UnsupportedModelError(
            f"{modeling_file.name}: cannot convert: the standalone Legacy MLA path (nope / rope "
            "rows) is not converted to mode 3 yet"
        )
    if options.kv_mode not in ("auto", "paged"):
        raise UnsupportedModelError(
            f"{modeling_file.name}: cannot convert: --kv-mode {options.kv_mode}: the model is "
            "already standalone mode 1 (Legacy rows); the rewrite writes mode 2 (paged) only"
        )
    spec = ConversionSpec.from_plan(
        plan, fa_version=options.fa_version, block_size=options.block_size
    )
    original = read_source(modeling_file)
    converted = convert_standalone_legacy_source(original, spec, filename=modeling_file.name)
    runners = {p.name: read_source(p) for p in sorted(modeling_file.parent.glob("runner_*.py"))}
    record = StandaloneRecord(
        runner=next(iter(runners), ""),
        kv_mode="paged",
        mode=2,
        mla_absorb=False,
        input_layout="TND",
        block_size=spec.block_size,
    )
    return Conversion(
        plan=plan, original=original, converted=converted, added=runners, standalone=record
    )


__all__ = ["convert_standalone_own_legacy"]
