"""The Plan: the analyzer's decisions about a model's KV cache, with evidence.

The Plan is a frozen value passed from the analyzer to the implementer and written to
``kvskill_plan.json``. ``to_dict()`` emits the stable JSON contract of the design (keys are
added freely, never renamed); ``from_dict()`` / ``from_json()`` read it back, validating every
closed set. Closed sets are ``str``-valued enums whose values are the JSON strings, so a Plan
compares, hashes and formats like the strings it was read from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from kvskill.core.attn_types import AttnType
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import loads_json, read_text


class PlanEnum(str, Enum):
    """A closed set of the Plan. NOTE: ``str()`` and f-strings give the value (the JSON
    string), as ``enum.StrEnum`` does on 3.11, so messages and evidence read unchanged."""

    __str__ = str.__str__
    __format__ = str.__format__


class AttentionKind(PlanEnum):
    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"


class KvMode(PlanEnum):
    """Paged (the default) or Legacy (contiguous caches) when Paged is impossible."""

    PAGED = "paged"
    LEGACY = "legacy"


class InputLayout(PlanEnum):
    """The fused-attention ``input_layout`` the converted attention uses."""

    TND = "TND"
    TND_NTD = "TND_NTD"
    BSH = "BSH"


class FaVersion(PlanEnum):
    """The fused-attention operator: v1 ``npu_fused_infer_attention_score`` or its ``_v2``."""

    V1 = "v1"
    V2 = "v2"


class DeployMode(PlanEnum):
    """Who owns the KV cache: the bundled runtime (framework) or a generated runner."""

    FRAMEWORK = "framework"
    STANDALONE = "standalone"


class SourceKind(PlanEnum):
    TRANSFORMERS = "transformers"
    DIRECTORY = "directory"
    REMOTE_CODE = "remote_code"


class RopeStyle(PlanEnum):
    HALF = "half"
    INTERLEAVED = "interleaved"
    NONE = "none"


class PositionBias(PlanEnum):
    """A bias added to the attention scores by position (instead of, or beside, rotary)."""

    #: ALiBi: a per-head slope times the key's distance (bloom, mpt, Baichuan-13B)
    ALIBI = "alibi"


class MlaCacheWrite(PlanEnum):
    """How an MLA latent reaches the caches."""

    #: npu_kv_rmsnorm_rope_cache on the raw down-projection, cache_mode="PA_NZ"
    FUSED = "fused"
    #: npu_scatter_nd_update_ of the source's normalised latent and rotated key, NZ rows
    SCATTER = "scatter"


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
    #: "attention" | "mla" | "linear_attention" | "mamba" | ... (the config's layer kind)
    kind: str
    attn_type: AttnType
    #: window in tokens (keys a query may see, including itself), or None
    sliding_window: int | None = None
    #: the layer whose cache this layer reads (cross-layer KV sharing), None: its own
    kv_source: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "attn_type", AttnType(self.attn_type))


@dataclass(frozen=True, kw_only=True)
class CacheEntryPlan:
    """One cache tensor a layer of this kind declares (per layer)."""

    cache_name: str
    #: elements per head; a state entry has a shape, e.g. [conv_kernel - 1, conv_dim]
    dim: int | list[int]
    num_head: int
    dtype: str
    sliding_window: int | None = None
    #: tokens folded into one row (1: a row per token); a block of block_size tokens holds
    #: block_size // compress_ratio rows
    compress_ratio: int = 1
    #: groups the entry under this key instead of its attn_type (its own pool and table)
    manager_key: str | None = None
    #: layers declaring it, when not every layer of its attn_type does (None: all of them)
    num_layers: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON record; the compressed-cache keys only where they say something."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, default in _ENTRY_DEFAULTS.items():
            if record[name] == default:
                del record[name]
        return record


#: CacheEntryPlan keys a plan file leaves out at these values (plans written before them)
_ENTRY_DEFAULTS = {"compress_ratio": 1, "manager_key": None, "num_layers": None}


@dataclass(frozen=True, kw_only=True)
class SparseModes:
    """The FA ``sparse_mode`` of one attn_type in prefill and in decode."""

    prefill: int
    decode: int


@dataclass(frozen=True, kw_only=True)
class WindowTokens:
    """The FA ``pre_tokens`` / ``next_tokens`` of a sliding-window attn_type."""

    pre_tokens: int
    next_tokens: int


@dataclass(frozen=True, kw_only=True)
class MlaDims:
    """The latent dimensions of an MLA model."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    #: layers without a rope part (Mistral Large 4's ``no_rope_layers`` 0): their query and
    #: latent key carry no rotary dims; None when the config has no such list
    nope_layers: list[int] | None = None
    #: {consumer layer: the layer whose latent it attends to} (``kv_source_layers``); {} when
    #: the config says every layer keeps its own, None when it says nothing
    reused_latent: dict[str, int] | None = None


@dataclass(frozen=True, kw_only=True)
class IndexerPlan:
    """The DSA indexer of indexed sparse attention (DeepSeek-V3.2): per layer a top-k of the
    context positions, scored over a key cache of its own, picks what the attention reads."""

    #: query heads of the indexer and the width of its one key head
    n_heads: int
    head_dim: int
    #: positions each query keeps (the operators' ``sparse_count``)
    topk: int
    #: the layers' extra cache entry, paged beside the latent (same blocks, same block table)
    key_cache: str
    #: cache bytes per token of one layer's indexer keys
    key_cache_bytes_per_token: int
    #: the selection operator and the attention over what it selects
    operators: list[str]
    #: the layers that run the indexer and keep ``key_cache``
    layers: list[int] = field(default_factory=list)
    #: the layers that reuse the top-k of the previous indexer layer (GLM-5's "shared"
    #: ``indexer_types``): no indexer module, no ``key_cache``
    shared_layers: list[int] = field(default_factory=list)
    #: the layers that run no indexer and attend densely, full or sliding (dots3_note):
    #: no ``key_cache``
    dense_layers: list[int] = field(default_factory=list)
    #: tokens pooled into one scored key (GLM-5.3's ``index_kpool``; 1: a key per token);
    #: ``topk // pool_size`` pools are kept and expanded into their tokens
    pool_size: int = 1
    #: the query's open pool (its visible tokens of an incomplete pool) is always attended
    select_tail: bool = False
    #: the pooled indexer's parts, each with its construct, line and what it needs
    sub_features: list[CompressedSubFeature] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class MtpPlan:
    """The MTP layers and what speculative decoding with them costs (None: the model has none)."""

    #: MTP layers the config declares (k)
    num_layers: int
    #: the config key that gave k
    config_key: str
    #: their decoder-layer indices N..N+k-1 (N = num_hidden_layers)
    layer_indices: list[int]
    #: checkpoint key prefixes of their tensors
    weight_prefixes: list[str]
    #: the attn_type each MTP layer's attention declares
    attn_type: str
    #: the cache entries ONE MTP layer declares (those of a main layer of its attn_type)
    cache_entries: list[CacheEntryPlan]
    #: KV bytes per token of all MTP layers together
    bytes_per_token: int
    #: kv_bytes_per_token with speculative decoding on: the main layers' plus the MTP layers'
    #: (kv_bytes_per_token itself counts the main layers only: without speculation the MTP
    #: layers are not built and hold no cache)
    kv_bytes_per_token_speculative: int
    #: draft tokens per verify step by default (one per MTP layer); a verify step feeds
    #: next_n + 1 tokens per request, so the pools keep next_n extra slots per request, and
    #: a gated-delta model's state groups 1 + next_n state blocks per request
    next_n: int
    #: how the MTP caches join the model's (the framework's merge)
    merge: str
    #: why speculative decoding with these layers is not supported, None when it is
    speculative_refusal: str | None = None


@dataclass(frozen=True, kw_only=True)
class CompressedLayerKind:
    """One kind of layer of compressed attention (DeepSeek-V4): sliding only, CSA or HCA."""

    #: the config's name (``layer_types``) and its short form ("sliding" | "CSA" | "HCA")
    layer_type: str
    name: str
    layer_indices: list[int]
    #: tokens per compressed entry (1: the layer keeps only its window)
    compress_ratio: int
    #: tokens of the window every layer attends uncompressed
    sliding_window: int
    #: one layer's token caches, as the framework declares them
    caches: list[CacheEntryPlan]
    #: cache bytes one token adds to one layer of this kind (compressed rows / ratio)
    bytes_per_token: int
    #: the top-k indexer over compressed keys (CSA): n_heads, head_dim, topk
    indexer: dict[str, Any] | None
    #: what the framework's paged path calls for this kind, and those torch_npu 2.13.0 lacks
    operators: list[str]
    operators_missing: list[str]


@dataclass(frozen=True, kw_only=True)
class CompressedSubFeature:
    """One part of an attention the paged rewrite reads part by part (DeepSeek-V4's window,
    sinks, compressor state, CSA indexer, HCA; GLM-5.3's pooled indexer): the construct the
    modeling file has, what a paged conversion calls for it, and why it does not convert
    today ("" when it does)."""

    name: str
    construct: str
    #: "modeling_x.py:LINE"
    where: str
    needs: str
    missing: str = ""


@dataclass(frozen=True, kw_only=True)
class CompressedAttentionPlan:
    """The compressed layers of a model and what converting them would need."""

    kinds: list[CompressedLayerKind]
    #: layer types the config names that none of the kinds above describes
    unknown_layer_types: list[str]
    #: operator -> whether the torch_npu 2.13.0 wheel has it
    wheel_operators: dict[str, bool]
    #: where the attention's learnable per-head sink logits live (every layer's softmax
    #: takes them), None when it has none
    sinks: str | None = None
    #: each sub-feature found in the modeling file, in the order the attention runs them
    sub_features: list[CompressedSubFeature] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "sub_features", [_record(CompressedSubFeature, f) for f in self.sub_features]
        )
        kinds = [
            k if isinstance(k, CompressedLayerKind) else CompressedLayerKind(**k)
            for k in self.kinds
        ]
        for kind in kinds:
            caches = [_record(CacheEntryPlan, e) for e in kind.caches]
            object.__setattr__(kind, "caches", caches)
        object.__setattr__(self, "kinds", kinds)


@dataclass(frozen=True, kw_only=True)
class PlanSource:
    """Where the model came from."""

    kind: SourceKind
    #: the model directory (None for a transformers model type)
    path: str | None
    modeling_file: str | None
    config_file: str | None
    #: a composite model whose language model this Plan converts (``text_config``)
    language_model_of: str | None = None
    #: the ``*ForConditionalGeneration`` class converted whole (its own text decoder)
    vision_language_head: str | None = None
    #: the installed transformers modeling file the remote modeling file takes its attention
    #: from (subclassed or built as is); apply converts it into the output directory
    inherits_code: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SourceKind(self.kind))

    def to_dict(self) -> dict[str, Any]:
        # NOTE: the optional keys are absent, not null, when unset (the JSON of before).
        data = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        for key in ("language_model_of", "vision_language_head", "inherits_code"):
            if data[key] is None:
                del data[key]
        return data


#: how each structured field is rebuilt from plain data (JSON) on construction
_FIELD_TYPES: dict[str, Any] = {
    "source": PlanSource,
    "deploy_mode": DeployMode,
    "kv_mode": KvMode,
    "attention": AttentionKind,
    "fa_version": FaVersion,
    "input_layout": InputLayout,
    "rope_style": RopeStyle,
}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every decision of the analyzer. Field names are the JSON contract.

    Plain data (strings, dicts) given for a structured field is turned into its enum or
    record on construction, so ``dataclasses.replace(plan, kv_mode="legacy")`` stays typed.
    """

    model_type: str
    architecture: str
    source: PlanSource
    deploy_mode: DeployMode
    kv_mode: KvMode
    legacy_reason: str | None
    attention: AttentionKind
    layers: list[LayerPlan]
    attn_types: list[AttnType]
    mixed_attn_types: bool
    fa_version: FaVersion
    fa_version_reason: str
    mla_absorb: bool
    input_layout: InputLayout
    #: {attn_type: SparseModes}
    sparse_mode: dict[str, SparseModes]
    softmax_scale: float
    num_key_value_heads_per_rank: int
    #: {attn_type: [CacheEntryPlan]}
    cache_entries: dict[str, list[CacheEntryPlan]]
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
    #: {attn_type: WindowTokens} for the FA call
    window_tokens: dict[str, WindowTokens] = field(default_factory=dict)
    has_sinks: bool = False
    rope_style: RopeStyle = RopeStyle.HALF
    #: channels per head the rotary embedding turns when fewer than head_dim (partial rotary:
    #: GPT-NeoX's rotary_pct, ChatGLM's half head); None when the whole head is rotated
    rotary_dim: int | None = None
    #: a positional bias of the attention scores ("alibi"), None when there is none
    position_bias: PositionBias | None = None
    #: MLA dimensions when attention is MLA
    mla: MlaDims | None = None
    #: the DSA indexer when the attention is indexed sparse attention, else None
    indexer: IndexerPlan | None = None
    #: the compressed layers (DeepSeek-V4) when the model has them, else None
    compressed_attention: CompressedAttentionPlan | None = None
    #: facts from the code scan: attention class names, decoder/model/CausalLM classes, ...
    #: (an open set of scan results, kept as plain data)
    code: dict[str, Any] = field(default_factory=dict)
    #: the normalised config values used for the decisions (the model's own config)
    config: dict[str, Any] = field(default_factory=dict)
    #: memory plan: {"block_size", "kv_memory_bytes", "num_blocks", "max_tokens", ...}; with a
    #: budget, "num_blocks_by_group" is what ``kvskill run --kv-memory`` allocates per group
    #: (null block included, ``kvskill.core.kv_blocks``)
    memory: dict[str, Any] = field(default_factory=dict)
    #: reasons the implementer cannot convert this model yet (not a refusal of analysis)
    implementer_blockers: list[str] = field(default_factory=list)
    #: MLA models: the model class sets ModelCacheInfo(is_mla_backend=True)
    is_mla_backend: bool = False
    #: MLA models: how the latent reaches the caches; the evidence "mla_cache_write" says why
    mla_cache_write: MlaCacheWrite | None = None
    #: models with recurrent-state layers: each state layer's mixer kind, the states (shape,
    #: dtype, bytes), bytes per request and the page size chosen (analyzer/state_cache.py);
    #: {} for a model without state layers
    state_cache: dict[str, Any] = field(default_factory=dict)
    #: the multi-token-prediction layers (analyzer/mtp.py), None when the config has none
    mtp: MtpPlan | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name, kind in _FIELD_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                put(name, kind(**value))
            elif not isinstance(value, kind):
                put(name, kind(value))
        put("layers", [_record(LayerPlan, layer) for layer in self.layers])
        put("attn_types", [AttnType(t) for t in self.attn_types])
        put("evidence", [_record(Evidence, item) for item in self.evidence])
        put("sparse_mode", {str(k): _record(SparseModes, v) for k, v in self.sparse_mode.items()})
        put(
            "window_tokens",
            {str(k): _record(WindowTokens, v) for k, v in self.window_tokens.items()},
        )
        put(
            "cache_entries",
            {
                str(k): [_record(CacheEntryPlan, e) for e in entries]
                for k, entries in self.cache_entries.items()
            },
        )
        if self.mla is not None:
            put("mla", _record(MlaDims, self.mla))
        if self.indexer is not None:
            put("indexer", _record(IndexerPlan, self.indexer))
        if self.compressed_attention is not None:
            put("compressed_attention", _record(CompressedAttentionPlan, self.compressed_attention))
        if self.mtp is not None:
            mtp = _record(MtpPlan, self.mtp)
            entries = [_record(CacheEntryPlan, e) for e in mtp.cache_entries]
            put("mtp", replace(mtp, cache_entries=entries))
        if self.mla_cache_write is not None:
            put("mla_cache_write", MlaCacheWrite(self.mla_cache_write))
        if self.position_bias is not None:
            put("position_bias", PositionBias(self.position_bias))

    @property
    def is_mla(self) -> bool:
        return self.attention is AttentionKind.MLA

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract as plain data (lists, dicts, str, int, float, bool, None)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a Plan written by ``to_dict`` (unknown keys, e.g. ``conversion``, are
        ignored).

        Raises:
            BadInputError: a key is missing, or a value is not one the Plan allows.
        """
        if not isinstance(data, dict):
            raise BadInputError(f"a plan is a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        try:
            return cls(**values)
        except ValueError as exc:
            raise BadInputError(f"invalid plan: {_field_error(exc, values)}") from exc
        except TypeError as exc:
            raise BadInputError(f"invalid plan: {exc}") from exc

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> Plan:
        """Read a Plan from a file (``kvskill analyze --format json`` or a converted
        directory's ``kvskill_plan.json``) or from JSON text.

        Raises:
            BadInputError: unreadable file, malformed JSON, or an invalid plan.
        """
        return cls.from_dict(read_json_object(path_or_text))

    def layer_attn_types(self) -> list[AttnType]:
        """attn_type of every layer, in layer order."""
        return [layer.attn_type for layer in self.layers]

    def pinned_state_dtypes(self) -> dict[str, str]:
        """{state name: dtype} of the recurrent states the model keeps in a dtype of their own
        whatever the weights' dtype (``state_cache`` rows marked ``pinned``)."""
        rows = self.state_cache.get("states") or []
        return {row["cache_name"]: row["dtype"] for row in rows if row.get("pinned")}


#: Fields a reviewer may edit in a plan file: ``apply --plan`` converts with their values and
#: records them. Everything else is a fact of the model (or follows from facts and choices).
CHOICE_FIELDS = ("deploy_mode", "fa_version", "block_size", "attn_tp_size")
#: Fields recomputed from the model and the choices (the KV heads a rank holds, the cache
#: entries and their bytes, the memory plan of ``analyze --kv-memory``); not compared.
DERIVED_FIELDS = (
    "num_key_value_heads_per_rank",
    "cache_entries",
    "kv_bytes_per_token",
    "memory",
    "state_cache",
    "mtp",
)
#: Prose and findings: explanations of the decisions, not decisions; not compared.
NOTE_FIELDS = ("fa_version_reason", "legacy_reason", "warnings", "evidence", "implementer_blockers")


def fact_fields() -> tuple[str, ...]:
    """Fields that describe the model itself: a plan whose facts differ is stale."""
    skip = {*CHOICE_FIELDS, *DERIVED_FIELDS, *NOTE_FIELDS}
    return tuple(f.name for f in fields(Plan) if f.name not in skip)


def read_json_object(path_or_text: str | Path) -> dict[str, Any]:
    """The JSON object in a file, or in ``path_or_text`` itself when it is JSON text."""
    text, where = _json_text(path_or_text)
    # the checked reader of every input: a depth limit before parsing, one-line errors
    data = loads_json(text, what="plan", path=where)
    if not isinstance(data, dict):
        raise BadInputError(f"{where} must hold a JSON object, got {type(data).__name__}")
    return data


def _json_text(path_or_text: str | Path) -> tuple[str, str]:
    if isinstance(path_or_text, str) and path_or_text.lstrip().startswith("{"):
        return path_or_text, "the plan text"
    path = Path(path_or_text)
    return read_text(path, what="plan"), str(path)


def _record(cls: type, value: Any) -> Any:
    return value if isinstance(value, cls) else cls(**value)


def _field_error(exc: ValueError, values: dict[str, Any]) -> str:
    """Name the field and the values allowed for an enum value the Plan does not know."""
    optional = {"mla_cache_write": MlaCacheWrite, "position_bias": PositionBias}
    for name, kind in {**_FIELD_TYPES, **optional}.items():
        value = values.get(name)
        if isinstance(value, str) and value not in {m.value for m in kind}:
            allowed = ", ".join(m.value for m in kind)
            return f"{name} is {value!r}; allowed: {allowed}"
    return str(exc)


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "to_dict"):
            return value.to_dict()
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
