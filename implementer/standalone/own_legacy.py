"""The framework's own standalone Legacy model (mode 1) converted in place to mode 2 (its
MLA form to mode 3: absorbed MLA over the paged caches of mode 2).

Unlike the other standalone conversions, no runner is generated: the model directory has its
own (``runner_*.py``), which asks the model for its caches and each step's inputs. The
rewrite (KVR024, or KVR026 for MLA, and KVR025) changes what the model answers; the runner
files are written to the output unchanged, so the converted directory runs as the original
did.
"""

from __future__ import annotations

from pathlib import Path

from kvskill.analyzer import Plan
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions, Conversion, read_source
from kvskill.implementer.mla.spec import MlaSpec, check_mla_block_size
from kvskill.implementer.pipeline import convert_standalone_legacy_source
from kvskill.implementer.record import StandaloneRecord
from kvskill.implementer.spec import ConversionSpec, FaVersion


def convert_standalone_own_legacy(plan: Plan, options: ApplyOptions) -> Conversion:
    """Convert the standalone Legacy model of PLAN to mode 2, keeping its runner.

    An MLA model (latent and rope caches, KVR026) becomes mode 3: absorbed MLA over the
    paged caches of mode 2.

    Raises:
        UnsupportedModelError: a --kv-mode other than paged, or a structure the rewrite
            refuses.
    """
    modeling_file = Path(plan.source.modeling_file)
    if options.kv_mode not in ("auto", "paged"):
        raise UnsupportedModelError(
            f"{modeling_file.name}: cannot convert: --kv-mode {options.kv_mode}: the model is "
            "already standalone mode 1 (Legacy rows); the rewrite writes mode 2 (paged) only"
        )
    spec = (
        _mla_spec(plan, options)
        if plan.is_mla
        else ConversionSpec.from_plan(
            plan, fa_version=options.fa_version, block_size=options.block_size
        )
    )
    original = read_source(modeling_file)
    converted = convert_standalone_legacy_source(original, spec, filename=modeling_file.name)
    runners = {p.name: read_source(p) for p in sorted(modeling_file.parent.glob("runner_*.py"))}
    record = StandaloneRecord(
        runner=next(iter(runners), ""),
        kv_mode="paged",
        mode=3 if plan.is_mla else 2,
        mla_absorb=plan.is_mla,
        input_layout="TND",
        block_size=spec.block_size,
    )
    return Conversion(
        plan=plan, original=original, converted=converted, added=runners, standalone=record
    )


def _mla_spec(plan: Plan, options: ApplyOptions) -> ConversionSpec:
    """The spec of KVR025 / KVR026 for an MLA Plan, after the MLA limits (rope dim 64, latent
    512 or 128, the absorbed sparse modes) are checked. The Legacy call's operator and
    layout are kept (v1, TND): only its paging and lengths change."""
    check_mla_block_size(options.block_size)
    mla = MlaSpec.from_plan(plan, block_size=options.block_size)
    if options.fa_version not in ("auto", FaVersion.V1.value):
        raise UnsupportedModelError(
            f"{plan.model_type}: cannot convert: --fa-version {options.fa_version}: the "
            "standalone Legacy MLA rewrite keeps the model's own fused attention call (v1)"
        )
    return ConversionSpec(
        fa_version=FaVersion.V1,
        input_layout="TND",
        uniform_attn_type=mla.attn_type,
        sparse_mode={mla.attn_type: dict(mla.sparse_mode)},
        block_size=mla.block_size,
        causal_lm_class=plan.architecture,
    )


__all__ = ["convert_standalone_own_legacy"]
