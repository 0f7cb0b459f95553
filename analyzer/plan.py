"""The Plan: the analyzer's decisions about a model's KV cache, with evidence.

The Plan is a frozen value passed from the analyzer to the implementer and written to
``kvskill_plan.json``. ``to_dict()`` emits the stable JSON contract of the design (keys are
added freely, never renamed); ``from_dict()`` reads it back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """Why one decision was taken and where the fact came from."""

    #: the decision this supports, e.g. "kv_mode", "fa_version", "layers[3].attn_type"
    decision: str
    #: one sentence a reader can check
    reason: str
    #: where: "config.json:sliding_window", "modeling_qwen3.py:253", "flag --attn-tp-size"
    source: str


@dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """One decoder layer's cache kind."""

    index: int
    #: "attention" | "mla" | "linear_attention" | "mamba"
    kind: str
    #: AttnType value
    attn_type: str
    #: window in tokens (keys a query may see, including itself), or None
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class CacheEntryPlan:
    """One cache tensor a layer of this kind declares (per layer)."""

    cache_name: str
    dim: int | list[int]
    num_head: int
    dtype: str
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every decision of the analyzer. Field names are the JSON contract."""

    model_type: str
    architecture: str
    #: where the model came from: {"kind": "transformers"|"directory"|"remote_code",
    #: "path": ..., "modeling_file": ..., "config_file": ...}
    source: dict[str, Any]
    deploy_mode: str  # "framework" | "standalone"
    kv_mode: str  # "paged" | "legacy"
    legacy_reason: str | None
    attention: str  # "mha" | "gqa" | "mqa" | "mla"
    layers: list[LayerPlan]
    attn_types: list[str]
    mixed_attn_types: bool
    fa_version: str  # "v1" | "v2"
    fa_version_reason: str
    mla_absorb: bool
    input_layout: str  # "TND" | "TND_NTD" | "BSH"
    #: {attn_type: {"prefill": int, "decode": int}}
    sparse_mode: dict[str, dict[str, int]]
    softmax_scale: float
    num_key_value_heads_per_rank: int
    #: {attn_type: [CacheEntryPlan as dict]}
    cache_entries: dict[str, list[dict[str, Any]]]
    kv_bytes_per_token: int
    warnings: list[str]
    evidence: list[Evidence]

    # Additional facts the implementer and verify need (added keys, never renamed).
    num_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attn_tp_size: int = 1
    block_size: int = 128
    #: {attn_type: {"pre_tokens": int, "next_tokens": int}} for the FA call
    window_tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    has_sinks: bool = False
    #: "half" (rotate-half) | "interleaved" | "none"
    rope_style: str = "half"
    #: MLA dimensions when attention == "mla": kv_lora_rank, q_lora_rank,
    #: qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    mla: dict[str, int | None] | None = None
    #: facts from the code scan: attention class names, decoder/model/CausalLM classes, ...
    code: dict[str, Any] = field(default_factory=dict)
    #: the normalised config values used for the decisions
    config: dict[str, Any] = field(default_factory=dict)
    #: memory plan: {"block_size", "kv_memory_bytes", "num_blocks", "max_tokens"} or empty
    memory: dict[str, Any] = field(default_factory=dict)
    #: reasons the implementer cannot convert this model yet (not a refusal of analysis)
    implementer_blockers: list[str] = field(default_factory=list)
    #: MLA models: the model class sets ModelCacheInfo(is_mla_backend=True)
    is_mla_backend: bool = False
    #: MLA models: how the latent reaches the caches, "fused" (npu_kv_rmsnorm_rope_cache,
    #: PA_NZ) or "scatter" (npu_scatter_nd_update_); the evidence "mla_cache_write" says why
    mla_cache_write: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract as plain data (lists, dicts, str, int, float, bool, None)."""
        return _plain(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a Plan written by ``to_dict`` (unknown keys are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["layers"] = [LayerPlan(**layer) for layer in data.get("layers", [])]
        values["evidence"] = [Evidence(**item) for item in data.get("evidence", [])]
        return cls(**values)

    def layer_attn_types(self) -> list[str]:
        """attn_type of every layer, in layer order."""
        return [layer.attn_type for layer in self.layers]


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
