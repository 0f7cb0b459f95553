"""What the codemods need from a Plan, validated once at the boundary.

The codemods never read the Plan directly: ``ConversionSpec.from_plan`` turns the analyzer's
decisions into the handful of values the emitted code depends on and refuses (exit 3) anything
the framework rewrite cannot express yet, before a single file is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvskill.analyzer.config import text_config
from kvskill.analyzer.plan import AttentionKind, FaVersion, InputLayout, KvMode, Plan
from kvskill.core.attn_types import AttnType
from kvskill.core.errors import UnsupportedModelError

#: attn_types of layers that keep one recurrent state per request instead of per-token KV
STATE_ATTN_TYPES = frozenset({AttnType.MAMBA.value})
#: the key value ``pre_tokens``/``next_tokens`` default to in both FA versions ("unbounded")
FA_UNBOUNDED_TOKENS = 2147483647


@dataclass(frozen=True, kw_only=True)
class WindowRule:
    """How a sliding layer's FA window follows from the model's window W.

    ``pre_tokens = W + pre_offset``; with the operator admitting ``pre_tokens + 1`` keys
    (npu_ops §1.5) and the source model's W keys including the query itself, the analyzer's
    rule gives ``pre_offset = -1``, ``next_tokens = 0``.
    """

    pre_offset: int
    next_tokens: int


@dataclass(frozen=True, kw_only=True)
class ConversionSpec:
    """Everything the framework-mode codemods emit that depends on the analyzer's decisions."""

    fa_version: FaVersion
    input_layout: str
    #: attn_type of every attention layer when they do not mix types, else None (state
    #: layers, such as gated delta nets, are not attention layers: they are always "Mamba")
    uniform_attn_type: str | None
    #: attention layers of mixed types: config.layer_types value -> attn_type
    layer_type_to_attn_type: dict[str, str] = field(default_factory=dict)
    #: whether some layers are recurrent-state (Mamba group) layers, e.g. gated delta nets
    has_state_layers: bool = False
    #: {attn_type: {"prefill": int, "decode": int}}
    sparse_mode: dict[str, dict[str, int]] = field(default_factory=dict)
    #: sliding attn_types -> window rule
    windows: dict[str, WindowRule] = field(default_factory=dict)
    attn_tp_size: int = 1
    block_size: int = 128
    has_sinks: bool = False
    #: the class the Plan names as the causal LM; the model-class rewrite uses it when no
    #: class assigns ``self.lm_head`` (vendor heads named ``output`` / ``output_layer``)
    causal_lm_class: str | None = None
    #: whether the model's config names ``num_key_value_heads`` (MHA vendor configs do not)
    config_has_kv_heads: bool = True
    #: attention class -> {fused projection attribute: row layout} as the Plan read it from
    #: the code's cut (``contiguous`` / ``per_head`` / ``per_kv_group`` / ``unknown``); the
    #: converted class declares it so a tensor-parallel split cuts the rows the same way
    fused_qkv: dict[str, dict[str, str]] = field(default_factory=dict)
    #: {state name: dtype name} of the recurrent states the Plan pins (a float32 SSM state in
    #: a bfloat16 model); the state rewrites declare these dtypes, the others follow the layer
    pinned_state_dtypes: dict[str, str] = field(default_factory=dict)
    #: cross-layer KV sharing (the Plan's ``code.kv_sharing`` when it shares the cache): the
    #: test, valid at the end of the attention's ``__init__``, true in a layer that reads an
    #: earlier layer's cache instead of holding its own; None when every layer holds its own
    reads_shared_kv: str | None = None
    #: the config's boolean keys (``alibi``): what decides the attention branches the file
    #: proves config-decided (``implementer/decided_branches.py``)
    config_switches: dict[str, bool] = field(default_factory=dict)
    #: compressed attention (DeepSeek-V4): its compressed entries declare ``block_size`` as
    #: rows per block x ratio, as the framework does
    compressed_attention: bool = False
    #: whether the rewrite keeps the model's own attention math (Legacy) instead of replacing
    #: its kernel with the fused operator, so score changes the operator cannot express
    #: (soft-capping, ALiBi) do not block it
    keeps_model_kernel: ClassVar[bool] = False

    @property
    def has_attention_layers(self) -> bool:
        """False for a model of state layers only (mamba2), served by state groups alone."""
        return self.uniform_attn_type is not None or bool(self.layer_type_to_attn_type)

    @property
    def attn_types(self) -> list[str]:
        if self.uniform_attn_type is not None:
            return [self.uniform_attn_type]
        if not self.layer_type_to_attn_type:
            # NOTE: no planned layer is attention (bamba's default config), yet the file may
            # define attention classes for other configs: they are converted as full attention
            return [AttnType.FULL_ATTENTION.value]
        return sorted(set(self.layer_type_to_attn_type.values()))

    @classmethod
    def from_plan(
        cls, plan: Plan, *, fa_version: str = "auto", block_size: int | None = None
    ) -> ConversionSpec:
        """Validate the Plan for the framework rewrite and extract the emitted values.

        Raises:
            UnsupportedModelError: the Plan needs something this rewrite does not do yet.
        """
        _check_supported(plan)
        version = FaVersion(plan.fa_version if fa_version == "auto" else fa_version)
        if plan.has_sinks and version is FaVersion.V1:
            raise UnsupportedModelError(
                f"{plan.model_type}: the attention has learnable sinks, which only "
                "npu_fused_infer_attention_score_v2 supports (learnable_sink); use --fa-version "
                "v2 or auto"
            )
        types = [t for t in plan.layer_attn_types() if t not in STATE_ATTN_TYPES]
        uniform = types[0] if len(set(types)) == 1 else None
        # NOTE: a model of state layers only (mamba2) has no attention type to map
        mapping = {} if uniform is not None or not types else _layer_type_mapping(plan)
        return cls(
            fa_version=version,
            input_layout=plan.input_layout,
            uniform_attn_type=uniform,
            layer_type_to_attn_type=mapping,
            sparse_mode=_sparse_modes(plan, has_attention=bool(types)),
            windows=_window_rules(plan),
            attn_tp_size=plan.attn_tp_size,
            block_size=block_size or plan.block_size,
            has_sinks=plan.has_sinks,
            has_state_layers=any(t in STATE_ATTN_TYPES for t in plan.layer_attn_types()),
            causal_lm_class=plan.architecture,
            config_has_kv_heads="num_key_value_heads" in text_config(plan.config)[0],
            pinned_state_dtypes=pinned_state_dtypes(plan),
            fused_qkv=fused_qkv_layouts(plan),
            reads_shared_kv=_reads_shared_kv(plan),
            config_switches=config_switches(plan),
            compressed_attention=plan.compressed_attention is not None,
        )


def config_switches(plan: Plan) -> dict[str, bool]:
    """The config's boolean keys (``alibi``), which may decide an attention branch."""
    config = text_config(plan.config)[0]
    return {key: value for key, value in config.items() if isinstance(value, bool)}


def _reads_shared_kv(plan: Plan) -> str | None:
    sharing = plan.code.get("kv_sharing") or {}
    return sharing.get("reads_shared_when") if sharing.get("shared") else None


#: dtypes a state may be pinned to: the names the emitted code spells as ``torch.<name>``
STATE_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


def pinned_state_dtypes(plan: Plan) -> dict[str, str]:
    """The Plan's pinned state dtypes (``state_cache``), checked to be torch dtype names.

    Raises:
        UnsupportedModelError: a state is pinned to a dtype the runtime does not keep.
    """
    pinned = plan.pinned_state_dtypes()
    unknown = {name: dtype for name, dtype in pinned.items() if dtype not in STATE_DTYPES}
    if unknown:
        raise UnsupportedModelError(
            f"{plan.model_type}: cannot convert: states pinned to dtypes {unknown} (the config's "
            f"mamba_ssm_cache_dtype); expected one of {sorted(STATE_DTYPES)}"
        )
    return pinned


#: the analyzer's rule for paged TND full attention: causal (3) in prefill and decode
FULL_ATTENTION_SPARSE_MODE = {"prefill": 3, "decode": 3}


def _sparse_modes(plan: Plan, *, has_attention: bool) -> dict[str, dict[str, int]]:
    modes = {k: {"prefill": v.prefill, "decode": v.decode} for k, v in plan.sparse_mode.items()}
    if not has_attention:
        # attention classes no planned layer uses are converted as full attention
        modes.setdefault(AttnType.FULL_ATTENTION.value, dict(FULL_ATTENTION_SPARSE_MODE))
    return modes


def _check_supported(plan: Plan) -> None:
    name = plan.model_type
    reasons: list[str] = list(plan.implementer_blockers)
    if plan.kv_mode is not KvMode.PAGED:
        reasons.append(
            f"kv_mode is {plan.kv_mode.value!r} ({plan.legacy_reason}); only paged is rewritten"
        )
    if plan.attention is AttentionKind.MLA or plan.mla_absorb:
        reasons.append("MLA attention (latent nope/rope caches) is not rewritten yet")
    if plan.input_layout is not InputLayout.TND:
        reasons.append(f"input_layout {plan.input_layout.value!r}; the framework rewrite emits TND")
    unknown = sorted(
        {t for t in plan.layer_attn_types()}
        - {AttnType.FULL_ATTENTION.value, AttnType.SLIDING_WINDOW.value, *STATE_ATTN_TYPES}
    )
    if unknown:
        reasons.append(
            f"layers of attn_type {unknown} (only FullAttention, SlidingWindow and Mamba)"
        )
    if any(t in STATE_ATTN_TYPES for t in plan.layer_attn_types()) and plan.attn_tp_size != 1:
        reasons.append(
            f"attn_tp_size {plan.attn_tp_size} with recurrent-state (Mamba) layers; their "
            "states are not split over ranks yet"
        )
    if not plan.layers:
        reasons.append("the Plan lists no layers")
    if reasons:
        raise UnsupportedModelError(f"{name}: cannot convert: " + "; ".join(reasons))


def _layer_type_mapping(plan: Plan) -> dict[str, str]:
    layer_types: list[Any] | None = text_config(plan.config)[0].get("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) < len(plan.layers):
        raise UnsupportedModelError(
            f"{plan.model_type}: layers mix attention types but config.layer_types does not "
            "list every layer, so the per-layer attn_type cannot be written as code"
        )
    mapping: dict[str, str] = {}
    for layer in plan.layers:
        if layer.attn_type in STATE_ATTN_TYPES:
            continue
        value = str(layer_types[layer.index])
        if mapping.setdefault(value, layer.attn_type) != layer.attn_type:
            raise UnsupportedModelError(
                f"{plan.model_type}: layer_types value {value!r} maps to both "
                f"{mapping[value]} and {layer.attn_type}; the attn_type is not a function of "
                "config.layer_types"
            )
    return mapping


def _window_rules(plan: Plan) -> dict[str, WindowRule]:
    rules: dict[str, WindowRule] = {}
    for layer in plan.layers:
        if layer.attn_type != AttnType.SLIDING_WINDOW.value:
            continue
        tokens = plan.window_tokens.get(layer.attn_type)
        if not tokens or layer.sliding_window is None:
            raise UnsupportedModelError(
                f"{plan.model_type}: layer {layer.index} is SlidingWindow but the Plan has no "
                "window (window_tokens / sliding_window)"
            )
        window = text_config(plan.config)[0].get("sliding_window")
        if window != layer.sliding_window:
            raise UnsupportedModelError(
                f"{plan.model_type}: layer {layer.index} has window {layer.sliding_window} but "
                f"config.sliding_window is {window!r}; per-layer "
                "windows are not rewritten yet"
            )
        rule = WindowRule(
            pre_offset=tokens.pre_tokens - layer.sliding_window,
            next_tokens=tokens.next_tokens,
        )
        if rules.setdefault(layer.attn_type, rule) != rule:
            raise UnsupportedModelError(
                f"{plan.model_type}: sliding layers disagree on the window rule"
            )
    return rules


def fused_qkv_layouts(plan: Plan) -> dict[str, dict[str, str]]:
    """Attention class -> {fused projection: layout}, from the Plan's code facts."""
    attention = (plan.code or {}).get("attention") or {}
    return {
        name: {entry["fused_qkv"]["attr"]: entry["fused_qkv"]["layout"]}
        for name, entry in attention.items()
        if isinstance(entry, dict) and entry.get("fused_qkv")
    }
