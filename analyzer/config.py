"""One typed spec from any causal-LM config dict, with the key each value came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvskill.analyzer.config_keys import kv_heads as kv_head_count
from kvskill.analyzer.config_keys import lookup, ssm_value
from kvskill.core.cache_bytes import dtype_bytes
from kvskill.core.config_checks import decoder_config
from kvskill.core.errors import BadInputError, UnsupportedModelError

#: raw layer-type strings -> the analyzer's layer kind
_LAYER_KIND = {
    "full_attention": "attention",
    "attention": "attention",
    "global": "attention",
    "global_attention": "attention",
    "sliding_attention": "sliding",
    "sliding": "sliding",
    "local": "sliding",
    "local_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear_attention",
    "mamba": "mamba",
    "mamba2": "mamba",
    "conv": "conv",
    "recurrent": "recurrent",
    "hybrid": "hybrid",
    "hybrid_sliding": "hybrid",
    "indexed_attention": "indexed_attention",
    "compressed_sparse_attention": "compressed_attention",
    "heavily_compressed_attention": "compressed_attention",
    "mlp": "mlp",
    "moe": "mlp",
}


#: the layer_types value of a layer that runs the DSA indexer (dots3_note)
INDEXED_ATTENTION = "indexed_attention"

#: model types whose every layer is a state-space mixer (no attention at all)
STATE_SPACE_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba"})
#: model types whose "hybrid" layers each hold an attention KV cache and a Mamba state:
#: falcon_h1 runs its attention and its Mamba-2 mixer side by side on the layer's input; zamba
#: and zamba2 run a shared attention block (weights tied across layers, one cache per call
#: site), then the layer's own mixer (zamba's a multi-head Mamba-1, zamba2's a Mamba-2).
ATTENTION_AND_STATE_MODEL_TYPES = frozenset({"falcon_h1", "zamba", "zamba2"})


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Normalised facts of a model config. ``sources`` maps each field to its config key."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    #: per layer: "attention" | "sliding" | "chunked" | "linear_attention" | "mamba" | ...
    layer_kinds: list[str]
    #: where the per-layer pattern came from (a config key or a rule)
    layer_pattern_source: str
    sliding_window: int | None
    attention_chunk_size: int | None
    #: MLA ranks, or None for non-MLA attention
    mla: dict[str, int | None] | None
    rope_parameters: dict[str, Any]
    rope_interleave: bool
    dtype: str
    dtype_known: bool
    num_experts: int
    num_mtp_layers: int
    attn_logit_softcapping: float | None
    #: linear-attention / SSM dimensions for state entries ({} when there are none)
    state: dict[str, Any] = field(default_factory=dict)
    is_encoder_decoder: bool = False
    #: vocabulary (``vocab_size`` / ChatGLM's ``padded_vocab_size``), 0 when the config has none
    vocab_size: int = 0
    #: dense MLP width (``intermediate_size`` / ``ffn_hidden_size`` / ``n_inner``), 0 if unset
    intermediate_size: int = 0
    #: positions the model is built for (``max_position_embeddings`` / ``seq_length`` / ...)
    max_positions: int | None = None
    #: the config's ALiBi switch (Falcon's ``alibi``, MPT's ``attn_config.alibi``); None if unset
    alibi: bool | None = None
    #: the DSA indexer of indexed sparse attention ({"n_heads", "head_dim", "topk",
    #: "indexer_types"}: the last the per-layer list, or None when every layer runs its own),
    #: None without one
    indexer: dict[str, Any] | None = None
    #: layer index -> the config keys that layer sets for itself (transformers 5's
    #: ``per_layer_config``: only the keys that differ from the model's), {} without any
    layer_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: field -> the config key it was read from (a vendor's name where the config uses one)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype, default=2)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first(config: dict[str, Any], *keys: str) -> tuple[Any, str | None]:
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value, key
    return None, None


def text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The decoder's config and the prefix of its keys (``core.config_checks.decoder_config``:
    ``text_config`` for composite configs, else the config)."""
    return decoder_config(config)


def normalise(
    config: dict[str, Any],
    *,
    uses_sliding_window: bool = True,
    derived: dict[str, Any] | None = None,
    attribute_map: dict[str, str] | None = None,
) -> ModelSpec:
    """Build the ModelSpec. ``uses_sliding_window`` says whether the code reads a window;
    ``derived`` holds values the config class computes outside ``to_dict`` (layer_types);
    ``attribute_map`` is the config class's own (standard name -> the key it stores), so a
    vendor's key names are read (``config_keys``).

    Raises UnsupportedModelError when the config has no decoder layer count or heads.
    """
    cfg, prefix = text_config(config)
    sources: dict[str, str] = {}

    def get(name: str, *keys: str) -> Any:
        value, key = _first(cfg, *keys)
        if key is not None:
            sources[name] = prefix + key
        return value

    def named(name: str) -> Any:
        value, key = lookup(cfg, name, attribute_map)
        if key is not None:
            sources[name] = prefix + key
        return value

    num_layers = named("num_layers")
    hidden = named("hidden_size")
    heads = named("num_heads")
    if num_layers is None:
        for key in ("layer_types", "layers_block_type"):
            if isinstance(cfg.get(key), list) and cfg[key]:
                num_layers = len(cfg[key])
                sources["num_layers"] = f"{prefix}len({key})"
                break
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise UnsupportedModelError(
            f"config of '{config.get('model_type')}' has no decoder layer count "
            "(num_hidden_layers); not a causal decoder"
        )
    hidden = int(hidden or 0)
    heads = int(heads or 0)
    kv_heads, kv_key = kv_head_count(cfg, heads, attribute_map)
    if kv_key:
        sources["num_kv_heads"] = prefix + kv_key
    kv_heads = int(kv_heads or heads)
    if heads and kv_heads and heads % kv_heads:
        raise BadInputError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
            f"({sources.get('num_kv_heads', 'num_key_value_heads')})"
        )
    head_dim = named("head_dim")
    if not head_dim:
        head_dim = hidden // heads if heads else 0
        sources.setdefault("head_dim", f"{prefix}hidden_size / num_attention_heads")
    v_head_dim = get("v_head_dim", "v_head_dim") or head_dim
    mla = _mla(cfg, sources, prefix)
    vocab = named("vocab_size")
    intermediate = named("intermediate_size")
    max_positions = named("max_positions")
    sliding_window = get("sliding_window", "sliding_window", "window_size")
    if not isinstance(sliding_window, int) or sliding_window <= 0:
        sliding_window = None
    pattern_cfg = {**cfg, **(derived or {})} if "layer_types" not in cfg else cfg
    kinds, pattern_source = _layer_kinds(pattern_cfg, int(num_layers), sliding_window, prefix)
    if sliding_window is None or not uses_sliding_window:
        # A sliding layer without a window (or code that never reads it) is full attention.
        kinds = ["attention" if k == "sliding" else k for k in kinds]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope:
        sources["rope_parameters"] = prefix + (
            "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        )
    dtype_value = get("dtype", "dtype", "torch_dtype")
    dtype = str(dtype_value).replace("torch.", "") if dtype_value else "bfloat16"
    experts = get("num_experts", "num_experts", "n_routed_experts", "num_local_experts") or 0
    mtp = (
        get(
            "num_mtp_layers",
            "num_mtp_layers",
            "num_nextn_predict_layers",
            "mtp_num_layers",
            "mtp_num_hidden_layers",
        )
        or 0
    )
    softcap = get("attn_logit_softcapping", "attn_logit_softcapping")
    chunk = get("attention_chunk_size", "attention_chunk_size")
    return ModelSpec(
        model_type=str(config.get("model_type", "")),
        num_layers=int(num_layers),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(kv_heads or heads),
        head_dim=int(head_dim),
        v_head_dim=int(v_head_dim),
        layer_kinds=kinds,
        layer_pattern_source=pattern_source,
        sliding_window=sliding_window,
        attention_chunk_size=chunk if isinstance(chunk, int) else None,
        mla=mla,
        rope_parameters=dict(rope) if isinstance(rope, dict) else {},
        rope_interleave=bool(cfg.get("rope_interleave")),
        dtype=dtype,
        dtype_known=dtype_value is not None,
        num_experts=int(experts) if isinstance(experts, int) else 0,
        num_mtp_layers=int(mtp) if isinstance(mtp, int) else 0,
        attn_logit_softcapping=float(softcap) if softcap else None,
        state=_state_dims(cfg, hidden),
        is_encoder_decoder=bool(config.get("is_encoder_decoder")),
        vocab_size=vocab if _is_int(vocab) else 0,
        intermediate_size=intermediate if _is_int(intermediate) else 0,
        max_positions=max_positions if _is_int(max_positions) else None,
        alibi=_alibi_switch(cfg),
        indexer=_indexer(cfg, sources, prefix),
        layer_overrides=_layer_overrides(cfg, int(num_layers), sources, prefix),
        sources=sources,
    )


def _layer_overrides(
    cfg: dict[str, Any], num_layers: int, sources: dict[str, str], prefix: str
) -> dict[int, dict[str, Any]]:
    """``per_layer_config`` by layer index (its keys are the index as a string, "02", or an
    int); entries past the layer count or not a dict are not layers of this model."""
    raw = cfg.get("per_layer_config")
    if not isinstance(raw, dict):
        return {}
    found: dict[int, dict[str, Any]] = {}
    for key, values in raw.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            continue
        if 0 <= index < num_layers and isinstance(values, dict) and values:
            found[index] = dict(values)
    if found:
        sources["layer_overrides"] = prefix + "per_layer_config"
    return found


def _alibi_switch(cfg: dict[str, Any]) -> bool | None:
    for holder in (cfg, cfg.get("attn_config")):
        if isinstance(holder, dict) and isinstance(holder.get("alibi"), bool):
            return holder["alibi"]
    return None


def _mla(cfg: dict[str, Any], sources: dict[str, str], prefix: str) -> dict[str, int | None] | None:
    rank = cfg.get("kv_lora_rank")
    rope_dim = cfg.get("qk_rope_head_dim")
    # NOTE: 0 is a latent without a rope key (NoPE MLA, GLM-5.3's glm5_next): still MLA, its
    # cache is the latent alone; only a missing key means "not MLA"
    if not rank or not isinstance(rope_dim, int) or rope_dim < 0:
        return None
    sources["mla"] = prefix + "kv_lora_rank"
    return {
        "kv_lora_rank": int(rank),
        "q_lora_rank": cfg.get("q_lora_rank"),
        "qk_nope_head_dim": int(cfg.get("qk_nope_head_dim") or 0),
        "qk_rope_head_dim": int(rope_dim),
        "v_head_dim": int(cfg.get("v_head_dim") or 0),
        **_mla_layers(cfg, sources, prefix),
    }


def _mla_layers(cfg: dict[str, Any], sources: dict[str, str], prefix: str) -> dict[str, Any]:
    """Per-layer MLA facts of Mistral Large 4's config (analyzer/mla_layers.py reads them):
    ``no_rope_layers`` (1 = the layer rotates, 0 = a NoPE layer without a rope part) and
    ``kv_source_layers`` (the layer whose latent each layer attends to)."""
    found: dict[str, Any] = {}
    count = cfg.get("num_hidden_layers")
    flags = cfg.get("no_rope_layers")
    if isinstance(flags, list) and isinstance(count, int):
        sources["mla.nope_layers"] = prefix + "no_rope_layers"
        found["nope_layers"] = [i for i, flag in enumerate(flags[:count]) if not flag]
    owners = cfg.get("kv_source_layers")
    if isinstance(owners, list) and isinstance(count, int):
        sources["mla.reused_latent"] = prefix + "kv_source_layers"
        found["reused_latent"] = {
            str(i): int(src) for i, src in enumerate(owners[:count]) if src != i
        }
    return found


#: the DSA indexer's config keys (DeepSeek-V3.2, GLM-5): its query heads, its key width and
#: how many positions each query keeps
_INDEXER_KEYS = {"n_heads": "index_n_heads", "head_dim": "index_head_dim", "topk": "index_topk"}


def _indexer(cfg: dict[str, Any], sources: dict[str, str], prefix: str) -> dict[str, Any] | None:
    values = {name: cfg.get(key) for name, key in _INDEXER_KEYS.items()}
    if not all(_is_int(v) and v > 0 for v in values.values()):
        return None
    sources["indexer"] = prefix + "index_topk"
    # GLM-5's indexer_types: "full" layers run their indexer, "shared" ones reuse the
    # previous full layer's top-k (analyzer/indexer.py reads the list)
    kinds = cfg.get("indexer_types")
    if isinstance(kinds, list):
        sources["indexer_types"] = prefix + "indexer_types"
    # dots3_note's layer_types: only its "indexed_attention" layers run the indexer, the
    # others attend densely (full or sliding) and keep no indexer keys
    types = cfg.get("layer_types")
    indexed = (
        [i for i, t in enumerate(types) if t == INDEXED_ATTENTION]
        if isinstance(types, list) and INDEXED_ATTENTION in types
        else None
    )
    if indexed is not None:
        sources["indexed_layers"] = prefix + "layer_types"
    # GLM-5.3's k-pool indexer: it scores one gated key per index_kpool tokens and may add the
    # query's open pool (analyzer/pooled_indexer.py)
    pool = cfg.get("index_kpool")
    if _is_int(pool) and pool > 1:
        sources["index_kpool"] = prefix + "index_kpool"
    return {
        **{k: int(v) for k, v in values.items()},
        "indexer_types": [str(k) for k in kinds] if isinstance(kinds, list) else None,
        "indexed_layers": indexed,
        "kpool": int(pool) if _is_int(pool) and pool > 1 else 1,
        "select_tail": bool(cfg.get("index_kpool_always_select_tail")),
    }


def _layer_kinds(
    cfg: dict[str, Any], num_layers: int, window: int | None, prefix: str
) -> tuple[list[str], str]:
    """Per-layer kinds from ``layer_types`` or the older per-model patterns."""
    for key in ("layer_types", "layers_block_type"):
        types = cfg.get(key)
        if isinstance(types, list) and types:
            kinds = [_LAYER_KIND.get(str(t), "attention") for t in types[:num_layers]]
            kinds += ["attention"] * (num_layers - len(kinds))
            return kinds, prefix + key
    if cfg.get("model_type") in STATE_SPACE_MODEL_TYPES:
        # every layer a state layer; their configs list no layer pattern in config.json
        return ["mamba"] * num_layers, prefix + "model_type"
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        # nemotron-h style: "M" mamba, "*" attention, "-"/"E" MLP or MoE (no cache)
        char_kind = {"M": "mamba", "*": "attention", "-": "mlp", "E": "mlp"}
        kinds = [char_kind.get(ch, "attention") for ch in pattern[:num_layers]]
        return kinds, prefix + "hybrid_override_pattern"
    if cfg.get("use_sliding_window") is not None and "max_window_layers" in cfg:
        if cfg.get("use_sliding_window") and window:
            first = int(cfg.get("max_window_layers") or 0)
            kinds = ["sliding" if i >= first else "attention" for i in range(num_layers)]
        else:
            kinds = ["attention"] * num_layers
        return kinds, prefix + "use_sliding_window+max_window_layers"
    period = cfg.get("sliding_window_pattern")
    if isinstance(period, int) and period > 0 and window:
        kinds = ["attention" if (i + 1) % period == 0 else "sliding" for i in range(num_layers)]
        return kinds, prefix + "sliding_window_pattern"
    if cfg.get("attn_layer_period"):
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset") or 0)
        kinds = ["attention" if i % period == offset else "mamba" for i in range(num_layers)]
        return kinds, prefix + "attn_layer_period+attn_layer_offset"
    if window:
        # Mistral style: a window with no per-layer pattern applies to every layer.
        return ["sliding"] * num_layers, prefix + "sliding_window"
    return ["attention"] * num_layers, "default (every layer full attention)"


def _state_dims(cfg: dict[str, Any], hidden: int) -> dict[str, Any]:
    """Conv / recurrent state dimensions of linear-attention or Mamba layers."""
    if cfg.get("linear_num_value_heads"):
        # gated delta net (qwen3-next style)
        k_heads = int(cfg.get("linear_num_key_heads") or 0)
        v_heads = int(cfg["linear_num_value_heads"])
        k_dim = int(cfg.get("linear_key_head_dim") or 0)
        v_dim = int(cfg.get("linear_value_head_dim") or 0)
        return {
            "conv_kernel": int(cfg.get("linear_conv_kernel_dim") or 4),
            "conv_dim": 2 * k_heads * k_dim + v_heads * v_dim,
            "num_state_heads": v_heads,
            "state_k_dim": k_dim,
            "state_v_dim": v_dim,
            # transformers' gated delta rule returns its state in float32 whatever the model's
            # dtype, and keeps it so between steps; a narrower state changes the logits
            "state_dtype": "float32",
            "mixer": "gated_delta",
        }
    if cfg.get("linear_num_heads") and cfg.get("linear_head_dim"):
        # Kimi delta attention (kimi-linear, bailing-hybrid): q, k, v heads of one size
        heads, dim = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
        return {
            "conv_kernel": int(cfg.get("linear_conv_kernel_dim") or 4),
            "conv_dim": 3 * heads * dim,
            "num_state_heads": heads,
            "state_k_dim": dim,
            "state_v_dim": dim,
            "state_dtype": "float32",
            # the delta rule with a decay per key channel (chunk_kda / fused_recurrent_kda)
            "mixer": "kda",
        }
    d_state = ssm_value(cfg, "state")
    if d_state:
        expand = ssm_value(cfg, "expand") or 2
        n_heads = ssm_value(cfg, "heads")  # (zamba2's is n_mamba_heads)
        head_dim = ssm_value(cfg, "head_dim")
        groups = ssm_value(cfg, "groups") or 1
        kernel = ssm_value(cfg, "conv_kernel")
        # the mixer's width. A hybrid's intermediate_size is its MLP's (jamba, bamba, zamba,
        # nemotron_h), so it counts only where nothing mamba-specific is there (mamba).
        if "mamba_d_ssm" in cfg:  # falcon_h1: mamba_d_ssm, else mamba_expand x hidden
            inner = cfg["mamba_d_ssm"] or int(expand * hidden)
        elif cfg.get("mamba_d_inner"):
            inner = cfg["mamba_d_inner"]
        elif isinstance(n_heads, int) and isinstance(head_dim, int) and n_heads * head_dim:
            inner = n_heads * head_dim  # Mamba-2: heads x head_dim channels
        elif "mamba_expand" in cfg:
            inner = int(cfg["mamba_expand"] * hidden)
        else:
            inner = cfg.get("intermediate_size") or int(expand * hidden)
        if isinstance(n_heads, int) and isinstance(head_dim, int) and n_heads * head_dim:
            # Mamba-2: per-head [head_dim, d_state] state; conv over x, B and C
            return {
                "conv_kernel": int(kernel or 4),
                "conv_dim": int(inner) + 2 * int(groups) * int(d_state),
                "num_state_heads": int(n_heads),
                "state_k_dim": int(head_dim),
                "state_v_dim": int(d_state),
                "mixer": "mamba2",
                **_ssm_cache_dtype(cfg),
            }
        # Mamba-1: [d_inner, d_state] state, conv over x only
        return {
            "conv_kernel": int(kernel or 4),
            "conv_dim": int(inner),
            "num_state_heads": 1,
            "state_k_dim": int(inner),
            "state_v_dim": int(d_state),
            "mixer": "mamba1",
            **_ssm_cache_dtype(cfg),
        }
    conv = cfg.get("conv_L_cache")
    if conv:
        # short-convolution layers (lfm2 style): only a conv state over the hidden size
        return {
            "conv_kernel": int(conv),
            "conv_dim": hidden,
            "num_state_heads": 0,
            "mixer": "short_conv",
        }
    return {}


def _ssm_cache_dtype(cfg: dict[str, Any]) -> dict[str, str]:
    """The SSM state's own dtype when the config pins it (nemotron_h's
    ``mamba_ssm_cache_dtype``: float32 in a bfloat16 model)."""
    value = cfg.get("mamba_ssm_cache_dtype")
    return {"state_dtype": str(value).removeprefix("torch.")} if isinstance(value, str) else {}


def pinned_state_dtypes(state: dict[str, Any]) -> dict[str, str]:
    """{state name: dtype} of the states whose dtype the model fixes whatever its weights'
    dtype: the SSM state of a gated delta net (float32), or of a Mamba mixer whose config sets
    ``mamba_ssm_cache_dtype``. Every other state is kept in the model's dtype.

    The Plan's per-state dtypes and the dtypes the converted layers pin both come from here.
    """
    dtype = state.get("state_dtype")
    return {"ssm_state": str(dtype)} if dtype and state.get("num_state_heads") else {}
