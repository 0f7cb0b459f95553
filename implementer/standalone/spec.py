"""What the standalone rewrite needs from a Plan: the KV mode, MLA absorb, and the refusals.

Standalone deployment has three KV modes. Mode 1 (contiguous, the Legacy layout) keeps one
``[batch, max_seq_len, kv_heads * head_dim]`` tensor per cache and attends in BSH (for a
Legacy Plan, whose attention no fused call expresses, one ``[batch, max_seq_len, kv_heads,
head_dim]`` row store per cache read by the model's own attention); mode 2
(paged) addresses ``[total_blocks, block_size, kv_heads, head_dim]`` caches through a static
block table and attends in TND; mode 3 (MLA absorb) caches the latent over mode 2. Every
combination the operators cannot run correctly is refused here (exit 3), before any file is
written: emitted code must be what runs right on an NPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvskill.analyzer.plan import KvMode as PlanKvMode
from kvskill.analyzer.plan import Plan
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.implementer.legacy_codemods import legacy_spec
from kvskill.implementer.mla.spec import MlaSpec, check_mla_block_size
from kvskill.implementer.registry import ConversionPath
from kvskill.implementer.spec import STATE_ATTN_TYPES, ConversionSpec


class KvMode(str, Enum):
    """Where the runner keeps the keys and values."""

    #: mode 1: per-layer ``[batch, max_seq_len, kv_heads * head_dim]`` BSH caches
    CONTIGUOUS = "contiguous"
    #: mode 2: per-layer ``[total_blocks, block_size, kv_heads, head_dim]`` caches
    PAGED = "paged"


class MlaAbsorb(str, Enum):
    """``--mla-absorb``: follow the analyzer, or insist on / refuse the absorbed path."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, kw_only=True)
class StandaloneSpec:
    """The standalone rewrite's decisions on top of the framework or MLA spec it reuses."""

    kv_mode: KvMode
    #: mode 3: absorbed MLA (cache_nope + cache_rope) over the paged caches
    mla: bool
    #: the attention codemods' spec: ConversionSpec, or MlaSpec when ``mla``
    base: ConversionSpec | MlaSpec
    #: mode 1 over the model's own attention math: one static row per request (a Legacy
    #: Plan: soft-capping, chunked attention), the runner's block being the whole row
    legacy: bool = False

    @property
    def input_layout(self) -> str:
        return "BSH" if self.kv_mode is KvMode.CONTIGUOUS else self.base.input_layout

    @property
    def block_size(self) -> int:
        return self.base.block_size

    @property
    def conversion_path(self) -> ConversionPath:
        """Modes 2 and 3 emit the framework rewrite's code; mode 1 the contiguous rewrite."""
        if self.mla:
            return ConversionPath.MLA
        if self.legacy:
            return ConversionPath.LEGACY
        if self.kv_mode is KvMode.PAGED:
            return ConversionPath.PAGED
        return ConversionPath.CONTIGUOUS

    @property
    def record_kv_mode(self) -> str:
        """The KV mode the conversion record names ("legacy" for rows of the model's own
        attention, else the mode's own name)."""
        return "legacy" if self.legacy else self.kv_mode.value

    @property
    def mode_number(self) -> int:
        """The standalone mode: 1 contiguous, 2 paged, 3 MLA absorb (over 2)."""
        if self.mla:
            return 3
        return 1 if self.kv_mode is KvMode.CONTIGUOUS else 2

    @classmethod
    def from_plan(
        cls,
        plan: Plan,
        *,
        kv_mode: str = "paged",
        mla_absorb: str = "auto",
        fa_version: str = "auto",
        block_size: int | None = None,
    ) -> StandaloneSpec:
        """Validate the Plan for the requested standalone mode.

        Raises:
            BadInputError: ``--mla-absorb on`` for a model without MLA attention.
            UnsupportedModelError: the operators cannot run this model in this mode.
        """
        mode = KvMode(kv_mode)
        absorb = MlaAbsorb(mla_absorb)
        if any(t in STATE_ATTN_TYPES for t in plan.layer_attn_types()):
            # The runner allocates and indexes attention caches only; the delta layers' conv
            # and ssm states live in the framework runtime's Mamba group.
            raise UnsupportedModelError(
                f"{plan.model_type}: cannot convert: recurrent-state (Mamba) layers are "
                "converted in framework mode only; use --mode framework"
            )
        if plan.kv_mode is PlanKvMode.LEGACY:
            if mode is KvMode.PAGED:
                raise UnsupportedModelError(
                    f"{plan.model_type}: cannot convert: --kv-mode paged: Legacy KV "
                    f"({plan.legacy_reason}); the fused attention cannot serve it in mode 2 "
                    "(TND); use --kv-mode auto or legacy (mode 1 over the model's own "
                    "attention)"
                )
            base = legacy_spec(plan, block_size)
            return cls(kv_mode=mode, mla=False, base=base, legacy=True)
        is_mla = plan.attention == "mla"
        if absorb is MlaAbsorb.ON and not is_mla:
            raise BadInputError(
                f"--mla-absorb on: {plan.model_type} has {plan.attention} attention, not MLA; "
                "use --mla-absorb auto or off"
            )
        if is_mla:
            _check_mla(plan, mode, absorb)
            check_mla_block_size(block_size)
            base = MlaSpec.from_plan(plan, fa_version=fa_version, block_size=block_size)
            return cls(kv_mode=mode, mla=True, base=base)
        spec = ConversionSpec.from_plan(plan, fa_version=fa_version, block_size=block_size)
        if mode is KvMode.CONTIGUOUS:
            _check_contiguous(plan, spec)
        return cls(kv_mode=mode, mla=False, base=spec)


def _check_mla(plan: Plan, mode: KvMode, absorb: MlaAbsorb) -> None:
    reasons = []
    if absorb is MlaAbsorb.OFF:
        reasons.append(
            "--mla-absorb off: the standalone MLA path caches only the latent (cache_nope + "
            "cache_rope) and attends absorbed; un-absorbed MLA is not generated, use "
            "--mla-absorb auto or on"
        )
    if mode is KvMode.CONTIGUOUS:
        reasons.append(
            "--kv-mode contiguous: the absorbed MLA attention is generated over the paged "
            "latent caches only (TND_NTD with block_table, NZ-layout writes); use "
            "--kv-mode paged (mode 3 over mode 2)"
        )
    if reasons:
        raise UnsupportedModelError(f"{plan.model_type}: cannot convert: " + "; ".join(reasons))


def _check_contiguous(plan: Plan, spec: ConversionSpec) -> None:
    """Mode 1 attends in BSH; refuse what BSH cannot express on the device."""
    reasons = []
    if spec.windows:
        reasons.append(
            "sliding-window layers: with BSH and one query token the fused attention runs its "
            "decode branch, which ignores sparse_mode and pre_tokens/next_tokens (npu_ops "
            "§1.4/§1.5), so the window would not be applied when decoding"
        )
    if spec.has_sinks:
        reasons.append(
            "learnable sinks: learnable_sink is accepted only with the TND and NTD_TND "
            "layouts (npu_ops §2.3), not BSH"
        )
    if reasons:
        raise UnsupportedModelError(
            f"{plan.model_type}: cannot generate --kv-mode contiguous (BSH): "
            + "; ".join(reasons)
            + "; use --kv-mode paged"
        )
