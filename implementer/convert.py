"""What ``apply`` was asked, and the framework conversion of a planned model (``str -> str``).

``convert_framework`` is framework mode's one entry: it takes a Plan, reads the modeling file
it names and returns the converted text; it writes nothing. Paged (MLA too), Legacy rows and
the framework's own Legacy model are its private cases below. The standalone conversion
(``standalone/convert.py``) returns the same :class:`Conversion`, with its runner among the
files it adds, so one writer (``writer.py``) writes both.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvskill.analyzer import Plan
from kvskill.analyzer.plan import AttentionKind, KvMode
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.core.inputs import read_source as checked_read_source
from kvskill.implementer.kv_mode import resolve_kv_mode
from kvskill.implementer.legacy_codemods import legacy_spec
from kvskill.implementer.mla import MlaSpec
from kvskill.implementer.pipeline import (
    convert,
    convert_framework_legacy_source,
    convert_mla_source,
    convert_source,
)
from kvskill.implementer.record import ReviewedPlan, StandaloneRecord
from kvskill.implementer.registry import ConversionPath
from kvskill.implementer.spec import ConversionSpec


@dataclass(frozen=True, kw_only=True)
class ApplyOptions:
    """What ``kvskill apply`` was asked to do."""

    deploy_mode: str = "framework"
    fa_version: str = "auto"
    attn_tp_size: int = 1
    block_size: int | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    force: bool = False
    copy_weights: bool = False
    #: "auto" | "on" | "off"; MLA is converted absorbed only, so "off" is refused for it
    mla_absorb: str = "auto"
    #: ``--kv-mode`` (``kv_mode.py``): "auto" follows the Plan; framework mode writes "paged" or
    #: "legacy", standalone mode "paged" (mode 2, or 3 for MLA) or "contiguous"/"legacy" (mode 1)
    kv_mode: str = "auto"
    #: ``--plan``: convert what this reviewed plan file says (``reviewed_plan.py``); its
    #: choices then replace deploy_mode, fa_version, attn_tp_size and block_size above
    plan_file: Path | None = None
    #: ``--prompt-file``: the task prompt whose ``部署模式:`` line decides an "auto" deploy mode
    prompt_file: Path | None = None
    #: ``--target``: "runtime" (kvskill's) or "cann-recipes" (the framework's executor tree)
    target: str = "runtime"


@dataclass(frozen=True, kw_only=True)
class Conversion:
    """One converted model, not yet written."""

    #: the Plan of what the written code does
    plan: Plan
    original: str
    converted: str
    #: files the deploy mode adds beside the modeling file: name -> text (the runner)
    added: dict[str, str] = field(default_factory=dict)
    #: the standalone record of kvskill_plan.json (None in framework mode)
    standalone: StandaloneRecord | None = None
    #: ``apply --plan``: the reviewed plan file and its choices
    reviewed: ReviewedPlan | None = None
    #: ``--target cann-recipes``: the class in the executor's model-class contract
    executor_class: str | None = None

    @property
    def modeling_file(self) -> str:
        return Path(self.plan.source.modeling_file).name


def source_package(plan: Plan) -> str | None:
    """Dotted package of a modeling file inside the installed transformers, else None.

    A model directory without its own modeling code (config and weights only) is converted
    from the installed transformers' file too, so its relative imports become absolute.
    """
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).resolve().parent.parent
    path = Path(plan.source.modeling_file).resolve()
    try:
        parts = path.relative_to(root).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(parts[:-1])


def read_source(path: Path) -> str:
    """The text of a modeling file, through the checked reader (size, encoding, nesting)."""
    return checked_read_source(path)


def convert_framework(plan: Plan, options: ApplyOptions) -> Conversion:
    """Convert the modeling file of a framework-mode Plan (MLA: latent caches, absorbed;
    Legacy: ``cache_unit`` caches in static rows)."""
    if resolve_kv_mode(plan, options.kv_mode) == "legacy":
        return _convert_framework_legacy(plan, options)
    if plan.code.get("legacy_framework"):
        return _convert_framework_own_legacy(plan, options)
    if plan.code.get("legacy_standalone"):
        raise UnsupportedModelError(
            f"{Path(plan.source.modeling_file).name}: cannot convert in framework mode: the "
            "framework's standalone Legacy model (rows from its own init_cache, scatter_update_ "
            f"at kv_len; {plan.code['legacy_standalone_source']}) is driven by its own runner; "
            "convert it with --mode standalone (mode 2, the runner kept)"
        )
    if plan.compressed_attention is not None:
        return _convert_compressed(plan, options)
    mla = plan.is_mla
    _check_mla_absorb(plan, options.mla_absorb)
    spec = (MlaSpec if mla else ConversionSpec).from_plan(
        plan, fa_version=options.fa_version, block_size=options.block_size
    )
    modeling_file = Path(plan.source.modeling_file)
    original = read_source(modeling_file)
    converted = (convert_mla_source if mla else convert_source)(
        original, spec, package=source_package(plan), filename=modeling_file.name
    )
    return Conversion(plan=plan, original=original, converted=converted)


def _convert_compressed(plan: Plan, options: ApplyOptions) -> Conversion:
    """Compressed attention (DeepSeek-V4) on the framework's custom operators
    (``compressed_attention.py``)."""
    spec = ConversionSpec.from_plan(
        plan, fa_version=options.fa_version, block_size=options.block_size
    )
    modeling_file = Path(plan.source.modeling_file)
    original = read_source(modeling_file)
    converted = convert(
        original,
        spec,
        ConversionPath.COMPRESSED,
        package=source_package(plan),
        filename=modeling_file.name,
    )
    return Conversion(plan=plan, original=original, converted=converted)


def _convert_framework_own_legacy(plan: Plan, options: ApplyOptions) -> Conversion:
    """The framework's own Legacy model (``cache_unit`` rows, BSH fused attention) converted
    in place to the executor's Paged contract; MLA Legacy models are not converted yet."""
    modeling_file = Path(plan.source.modeling_file)
    if plan.is_mla:
        raise UnsupportedModelError(
            f"{modeling_file.name}: cannot convert: the framework's Legacy MLA path (nope / rope "
            "caches) is not converted to Paged yet"
        )
    spec = ConversionSpec.from_plan(
        plan, fa_version=options.fa_version, block_size=options.block_size
    )
    original = read_source(modeling_file)
    converted = convert_framework_legacy_source(original, spec, filename=modeling_file.name)
    return Conversion(plan=plan, original=original, converted=converted)


def _check_mla_absorb(plan: Plan, choice: str) -> None:
    """``--mla-absorb on`` needs an MLA model; ``off`` is refused for one (absorbed only)."""
    mla = plan.attention is AttentionKind.MLA
    if choice == "on" and not mla:
        raise BadInputError(
            f"--mla-absorb on: {plan.model_type} has {plan.attention} attention, not MLA; "
            "use --mla-absorb auto or off"
        )
    if choice == "off" and mla:
        raise UnsupportedModelError(
            f"{plan.model_type}: cannot convert: --mla-absorb off: the MLA conversion caches "
            "only the latent (nope + rope caches) and attends absorbed; un-absorbed MLA is not "
            "generated, use --mla-absorb auto or on"
        )


def _convert_framework_legacy(plan: Plan, options: ApplyOptions) -> Conversion:
    """Convert a Legacy Plan's modeling file (``--kv-mode legacy``, or auto on a Legacy Plan).

    Seed 003 keeps Legacy for models the fused operator cannot serve (logit soft-capping,
    chunked attention): each attention declares its caches under attn_type "Legacy", the runtime
    gives every request one static row of ``max_model_len`` positions per cache (``[rows,
    max_model_len, num_head, dim]``), and the layer writes this step's keys and values at ``row
    * max_model_len + position`` (the positions ``scatter_update_`` at ``kv_len`` would address)
    and then calls the source's own attention function over its rows, with a mask built from the
    step's lengths, the layer's window and its chunk (``runtime/legacy_attention.py``).

    Only the seam changes: the cache update becomes the write and the read of the rows, the
    source's kernel call stays as written (so soft-capping, scaling and dropout stay the
    model's), and its output is packed back to the step's tokens.

    Raises:
        UnsupportedModelError: the model needs something the Legacy rewrite does not write.
    """
    assert options.kv_mode == "legacy" or plan.kv_mode is KvMode.LEGACY
    spec = legacy_spec(plan, options.block_size)
    modeling_file = Path(plan.source.modeling_file)
    original = read_source(modeling_file)
    converted = convert(
        original,
        spec,
        ConversionPath.LEGACY,
        package=source_package(plan),
        filename=modeling_file.name,
    )
    return Conversion(plan=plan, original=original, converted=converted)
