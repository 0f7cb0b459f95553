"""Shrink a model config for verification while keeping every structural feature.

Kept: the attention kind (MHA / GQA / MQA by the ratio of query to key-value heads), the
layer-type pattern (at least one layer of each kind, in source order), a sliding window
(made smaller than the verification prompts), MoE routing (top-k, number of experts above
top-k, shared experts, sparse-step pattern), MLA ranks within the operator's limits (see
``shrink_mla.py``), RoPE parameters, tied embeddings and learnable sinks. Sizes (hidden,
heads, head dim, vocabulary, intermediate) become tiny.

A composite config (a vision-language model: ``text_config`` + ``vision_config``) shrinks its
text decoder by the same rules, and its other towers to one layer each: verify runs text-only
prompts, so a tower is built and loaded but never run, and its full depth would only cost
memory (mllama's and emu3's unshrunk text configs did not fit in RAM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvskill.analyzer.analyze import PER_LAYER_HEAD_KEYS
from kvskill.analyzer.config import text_config
from kvskill.analyzer.config_keys import SSM_ALIASES, kv_heads, kv_heads_keys, lookup, write_keys
from kvskill.verify.shrink_mla import INDEX_N_HEADS, is_mla_config, shrink_mla

#: tiny sizes: fast on a CPU, big enough that a wrong mask or head mapping shows in logits.
#: head_dim stays 64, a size the fused attention accepts on every path (TND, learnable
#: sinks); hidden = heads * head_dim for models that derive head_dim from hidden_size.
NUM_HEADS = 4
HEAD_DIM = 64
HIDDEN_SIZE = NUM_HEADS * HEAD_DIM
INTERMEDIATE_SIZE = 128
EXPERT_INTERMEDIATE_SIZE = 32
VOCAB_SIZE = 256
NUM_EXPERTS = 4
#: the window shrinks to this many tokens so prompts run past it
SLIDING_WINDOW = 8
ATTENTION_CHUNK = 64
#: CSA's top-k in a shrunk compressed-attention twin: below the entries of its prompts (one
#: per 4 tokens), so the indexer drops entries
COMPRESSED_INDEX_TOPK = 8
MIN_LAYERS = 2

_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_EXPERT_SIZE_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: layer counts of a non-text tower (vision encoder, VQ model): each becomes TOWER_LAYERS
_TOWER_LAYER_KEYS = ("depth", "num_hidden_layers", "num_layers", "num_global_layers")
TOWER_LAYERS = 1


@dataclass(frozen=True, kw_only=True)
class ShrinkResult:
    config: dict[str, Any]
    #: key -> (old, new) for every value that changed
    changes: dict[str, tuple[Any, Any]]


def code_kv_key(config: dict[str, Any], code: dict[str, Any] | None) -> str | None:
    """The one config key the attention's ``__init__`` sizes its KV heads from (the Plan's
    ``code.kv_heads.config_keys``: ``num_query_groups``), when the config holds it as an
    int; None when the code reads several keys, or none."""
    keys = ((code or {}).get("kv_heads") or {}).get("config_keys") or []
    if len(keys) == 1 and _above(config.get(keys[0]), 0):
        return keys[0]
    return None


def _kv_heads(
    config: dict[str, Any], names: dict[str, str] | None = None, kv_key: str | None = None
) -> int:
    heads = lookup(config, "num_heads", names)[0] or NUM_HEADS
    kv = config[kv_key] if kv_key else (kv_heads(config, heads, names)[0] or heads)
    if kv == heads:
        return NUM_HEADS  # MHA
    if kv == 1:
        return 1  # MQA
    return 2  # GQA, group size 2


def _per_layer_lists(
    config: dict[str, Any], names: dict[str, str] | None = None
) -> dict[str, list[Any]]:
    """Config lists with one entry per layer: ``layer_types``, ``mlp_layer_types``,
    ``num_attention_heads_per_layer``, ``no_rope_layers``, ... (a key naming layers whose
    list is exactly ``num_hidden_layers`` long)."""
    total = lookup(config, "num_layers", names)[0]
    return {
        key: value
        for key, value in config.items()
        if ("layer" in key or key in PER_LAYER_MOE_KEYS or key in PER_LAYER_KIND_KEYS)
        and isinstance(value, list)
        and value
        and len(value) == total
    }


#: MoE sizes a config may give per layer instead of once (Hunyuan's ``moe_topk``,
#: ``num_shared_expert`` and ``moe_intermediate_size`` lists)
PER_LAYER_MOE_KEYS = ("moe_intermediate_size", "moe_topk", "num_shared_expert")
#: per-layer kinds whose key does not say "layer": GLM-5's ``indexer_types`` ("full" layers
#: run the DSA indexer, "shared" ones reuse the previous one's top-k), so a shrunk twin keeps
#: a layer of each
PER_LAYER_KIND_KEYS = ("indexer_types",)
#: per-layer lists of layer indices (Mistral Large 4's ``kv_source_layers``: the layer whose
#: latent each layer attends to): the kinds are "its own" and "another's"; cut to a prefix,
#: the indices stay valid (a layer names itself or an earlier one)
LAYER_INDEX_KEYS = ("kv_source_layers",)
#: config keys holding the router's top-k (a scalar, or one value per layer)
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")


#: layer kinds that call one shared block (zamba's and zamba2's "hybrid" layers): two of them
#: are kept, since transformers ties the block's weights from the first such layer to the
#: others (a model with one cannot be built) and each call site keeps a cache of its own
SHARED_BLOCK_KINDS = frozenset({"hybrid"})


def _num_layers(config: dict[str, Any], names: dict[str, str] | None = None) -> int:
    """Fewest leading layers that still hold every layer kind (at least MIN_LAYERS).

    Every per-layer list counts: the kept layers show each of its values at least once (an
    attention kind, an MLP kind, a head count, a no-rope flag).
    """
    total = int(lookup(config, "num_layers", names)[0] or MIN_LAYERS)
    needed = MIN_LAYERS
    for key, values in _per_layer_lists(config, names).items():
        if key in LAYER_INDEX_KEYS:
            # a layer index per layer: its kind is whether it names the layer itself
            values = [value == i for i, value in enumerate(values)]
        first_seen: dict[Any, int] = {}
        for i, value in enumerate(values):
            first_seen.setdefault(repr(value), i)
        needed = max(needed, max(first_seen.values()) + 1)
        shared = [i for i, value in enumerate(values) if value in SHARED_BLOCK_KINDS]
        if len(shared) > 1:
            needed = max(needed, shared[1] + 1)
    for key, offset in config.items():
        # a pattern by period and offset (Jamba's attn_layer_offset / expert_layer_offset):
        # the first layer of that kind is layer ``offset``
        period = config.get(key.removesuffix("_offset") + "_period")
        if key.endswith("_layer_offset") and _above(offset, -1) and _above(period, 1):
            needed = max(needed, offset + 1)
    sparse_step = config.get("decoder_sparse_step")
    if isinstance(sparse_step, int) and sparse_step > 1:
        needed = max(needed, sparse_step)  # keep a sparse (MoE) layer in the pattern
    return min(total, needed)


def shrink_config(
    config: dict[str, Any],
    *,
    shrink_window: bool = True,
    attribute_map: dict[str, str] | None = None,
    code: dict[str, Any] | None = None,
) -> ShrinkResult:
    """A tiny config with the same structure as ``config`` (which is not modified).

    ``code`` is the Plan's ``code`` section: the config key its attention sizes the KV heads
    from (``kv_heads.config_keys``) shrinks with the heads, whatever its name.

    Sizes are written under the keys the model reads: a vendor's own names (``n_layer``,
    ChatGLM's ``num_layers`` / ``kv_channels`` / ``padded_vocab_size``, ...) and the keys the
    config class's ``attribute_map`` maps the standard names to (``analyzer.config_keys``).

    ``shrink_window=False`` keeps ``sliding_window`` as it is, for a model none of whose
    layers attends over it: transformers may still build its cache from the window (moshi's
    ``DynamicCache`` windows every layer when there are no ``layer_types``), so a window
    shrunk below the prompts would change the original, not exercise the conversion.
    """
    if text_config(config)[1]:
        return _shrink_composite(
            config, shrink_window=shrink_window, names=attribute_map, code=code
        )
    return _shrink_decoder(config, shrink_window=shrink_window, names=attribute_map, code=code)


def _shrink_composite(
    config: dict[str, Any],
    *,
    shrink_window: bool,
    names: dict[str, str] | None = None,
    code: dict[str, Any] | None = None,
) -> ShrinkResult:
    """``text_config`` shrunk as a decoder, every other ``*_config`` tower to one layer."""
    inner = config["text_config"]
    # NOTE: the decoder keeps its head dim: multimodal rope splits the rotary half of each
    # head into sections sized for it, often by a default in the code that the config does
    # not list (qwen2_5_vl: [16, 24, 24] of 64).
    text = _shrink_decoder(
        inner,
        shrink_window=shrink_window,
        head_dim=_head_dim(inner, names),
        names=names,
        code=code,
    )
    towers = _shrink_towers({k: v for k, v in config.items() if k != "text_config"})
    changes = {f"text_config.{k}": change for k, change in text.changes.items()}
    changes.update(towers.changes)
    outer = _projection_widths(
        towers.config, inner.get("hidden_size"), text.config.get("hidden_size")
    )
    return ShrinkResult(config={**outer, "text_config": text.config}, changes=changes)


def _shrink_towers(config: dict[str, Any], prefix: str = "") -> ShrinkResult:
    """Every ``*_config`` below CONFIG to TOWER_LAYERS layers, and its vocabulary (a text
    encoder inside a vision tower: deepseek_ocr2) to VOCAB_SIZE, at any depth."""
    new, changes = dict(config), {}
    for key, tower in config.items():
        if not key.endswith("_config") or not isinstance(tower, dict):
            continue
        inner = _shrink_towers(tower, f"{prefix}{key}.")
        sizes = {k: TOWER_LAYERS for k in _TOWER_LAYER_KEYS if _above(tower.get(k), TOWER_LAYERS)}
        if _above(tower.get("vocab_size"), VOCAB_SIZE):
            sizes["vocab_size"] = VOCAB_SIZE
        new[key] = {**inner.config, **sizes, **_cut_tower_lists(tower, sizes)}
        changes.update(inner.changes)
        changes.update({f"{prefix}{key}.{k}": (tower[k], v) for k, v in sizes.items()})
    return ShrinkResult(config=new, changes=changes)


def _cut_tower_lists(tower: dict[str, Any], sizes: dict[str, int]) -> dict[str, list[Any]]:
    """A tower's per-layer lists (``layer_types``, ...) cut to its new layer count: config
    classes check that they are exactly as long (deepseek_ocr2, muse_spark)."""
    cut: dict[str, list[Any]] = {}
    for count_key, layers in sizes.items():
        if count_key not in _TOWER_LAYER_KEYS:
            continue
        for key, values in tower.items():
            if "layer" in key and isinstance(values, list) and len(values) == tower[count_key]:
                cut[key] = list(values[:layers])
    return cut


def _projection_widths(config: dict[str, Any], text_before: int, text_after: int) -> dict:
    """Towers' ``*_hidden_size`` widths that meet the text model (a merger's
    ``out_hidden_size``) follow its shrunk hidden size, at any depth; config classes may
    check that they match (granite_docling)."""
    new = dict(config)
    for key, value in config.items():
        if isinstance(value, dict) and key.endswith("_config"):
            new[key] = _projection_widths(value, text_before, text_after)
        elif key.endswith("_hidden_size") and value == text_before and text_before != text_after:
            new[key] = text_after
    return new


#: linear-attention (gated delta / KDA) head sizes: small, but a multiple of 4 so value heads
#: can stay a multiple of key heads
LINEAR_HEADS = 2
LINEAR_HEAD_DIM = 16


def _linear_attention_sizes(config: dict[str, Any]) -> dict[str, int]:
    """Gated delta / Kimi delta head counts and dims made small, keeping value heads a
    multiple (the same multiple, up to 2) of key heads: the recurrence of a full-size state
    layer is most of a verify run's time."""
    new: dict[str, int] = {}
    k_heads, v_heads = config.get("linear_num_key_heads"), config.get("linear_num_value_heads")
    if _above(k_heads, LINEAR_HEADS) and isinstance(v_heads, int) and v_heads % k_heads == 0:
        new["linear_num_key_heads"] = LINEAR_HEADS
        new["linear_num_value_heads"] = LINEAR_HEADS * min(v_heads // k_heads, 2)
    for key in ("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"):
        if _above(config.get(key), LINEAR_HEAD_DIM):
            new[key] = LINEAR_HEAD_DIM
    if _above(config.get("linear_num_heads"), LINEAR_HEADS):
        new["linear_num_heads"] = LINEAR_HEADS
    return new


def _rotary_width(
    config: dict[str, Any], head_dim: int, names: dict[str, str] | None
) -> dict[str, int]:
    """GPT-J style ``rotary_dim`` (rotated channels per head, in channels): the same share
    of the shrunk head, even and at least 2, so a partial rotation stays partial. Fractions
    (``partial_rotary_factor``, ``rotary_pct``) and ChatGLM's half-head rotation follow the
    head by themselves."""
    rotary = config.get("rotary_dim")
    old = _head_dim(config, names)
    if not _above(rotary, 0) or not _above(old, 0):
        return {}
    if rotary >= old:
        return {"rotary_dim": head_dim}
    return {"rotary_dim": max(2, rotary * head_dim // old // 2 * 2)}


def _largest_top_k(config: dict[str, Any]) -> int:
    """The most experts the router picks in any layer (a top-k key may be a per-layer
    list), at least 1."""
    values: list[Any] = []
    for key in _TOP_K_KEYS:
        value = config.get(key)
        values.extend(value if isinstance(value, list) else [value])
    return max([v for v in values if _above(v, 0)], default=1)


def _groups_dividing_heads(config: dict[str, Any], new: dict[str, Any]) -> dict[str, int]:
    """Head-group counts (``*group*`` keys that divided the query heads) that no longer
    divide the shrunk heads, made the largest divisor of them not above the old count; a
    count that still divides is left alone."""
    old_heads, heads = config.get("num_attention_heads"), new.get("num_attention_heads")
    if not _above(old_heads, 0) or not _above(heads, 0):
        return {}
    out: dict[str, int] = {}
    for key, value in new.items():
        if "group" not in key or not _above(value, 1) or config.get(key) != value:
            continue
        if old_heads % value == 0 and heads % value:
            out[key] = max(d for d in range(1, min(value, heads) + 1) if heads % d == 0)
    return out


def _above(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > limit


def _head_dim(config: dict[str, Any], names: dict[str, str] | None = None) -> int:
    heads = lookup(config, "num_heads", names)[0]
    head_dim = lookup(config, "head_dim", names)[0]
    hidden = lookup(config, "hidden_size", names)[0]
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    # head_dim 0 names no head width (glm5_next's rope-less MLA sizes its rotary by it)
    if isinstance(heads, int) and heads and isinstance(hidden, int):
        return hidden // heads
    return HEAD_DIM


def _put(
    new: dict[str, Any], config: dict[str, Any], name: str, value: Any, names: dict[str, str] | None
) -> None:
    """``value`` under every key of ``config`` the model reads ``name`` from."""
    for key in write_keys(config, name, names):
        new[key] = value


#: Mamba-2 mixers: small heads, a small state and chunks shorter than the prompts, so the SSD
#: scan crosses chunk boundaries and a request's state spans several chunks
SSM_HEAD_DIM = 16
SSM_STATE_SIZE = 16
SSM_CHUNK_SIZE = 8
#: widths a config stores as a whole multiple of hidden_size (zamba2 saves its derived
#: attention_hidden_size = 2 x hidden, and reads the saved value back over the derivation)
_HIDDEN_MULTIPLE_KEYS = ("attention_hidden_size",)


def _hidden_multiples(config: dict[str, Any], new: dict[str, Any]) -> dict[str, int]:
    """Each such width at the same multiple of the shrunk hidden size."""
    old_hidden, new_hidden = config.get("hidden_size"), new.get("hidden_size")
    if not isinstance(old_hidden, int) or not isinstance(new_hidden, int) or old_hidden <= 0:
        return {}
    out = {}
    for key in _HIDDEN_MULTIPLE_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value % old_hidden == 0:
            out[key] = value // old_hidden * new_hidden
    return out


def _ssm_sizes(config: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Mamba-2 sizes that stay consistent with the shrunk hidden size: heads x head_dim =
    expand x hidden (the configs check it), groups dividing the heads."""
    keys = {
        role: next((k for k in names if k in config), None) for role, names in SSM_ALIASES.items()
    }
    if keys["heads"] is None or keys["state"] is None or keys["expand"] is None:
        return {}
    expand = config[keys["expand"]]
    if not isinstance(expand, (int, float)) or not isinstance(new.get("hidden_size"), int):
        return {}
    inner = int(expand * new["hidden_size"])
    heads = inner // SSM_HEAD_DIM
    out: dict[str, Any] = {keys["heads"]: heads, keys["state"]: SSM_STATE_SIZE}
    if keys["head_dim"] is not None and isinstance(config[keys["head_dim"]], int):
        out[keys["head_dim"]] = SSM_HEAD_DIM
    if keys["groups"] is not None and isinstance(config[keys["groups"]], int):
        out[keys["groups"]] = 2 if config[keys["groups"]] > 1 else 1
    if keys["chunk"] is not None:
        out[keys["chunk"]] = SSM_CHUNK_SIZE
    if isinstance(config.get("mamba_d_ssm"), int):
        # falcon_h1 sizes its mixer by mamba_d_ssm when set (checked against heads x head_dim)
        out["mamba_d_ssm"] = inner
    return out


def _shrink_decoder(
    config: dict[str, Any],
    *,
    shrink_window: bool,
    head_dim: int = HEAD_DIM,
    names: dict[str, str] | None = None,
    code: dict[str, Any] | None = None,
) -> ShrinkResult:
    """``shrink_config`` of a decoder's own (flat) config, with heads of ``head_dim``."""
    new = dict(config)
    layers = _num_layers(config, names)
    _put(new, config, "num_layers", layers, names)
    for key, values in _per_layer_lists(config, names).items():
        new[key] = list(values[:layers])
    if "max_window_layers" in config and isinstance(config["max_window_layers"], int):
        new["max_window_layers"] = min(config["max_window_layers"], layers)
    kv_key = code_kv_key(config, code)
    kv = _kv_heads(config, names, kv_key)
    _put(new, config, "hidden_size", NUM_HEADS * head_dim, names)
    for key in [kv_key] if kv_key else kv_heads_keys(config, names):
        new[key] = kv
    _put(new, config, "num_heads", NUM_HEADS, names)
    new.update(_rotary_width(config, head_dim, names))
    if "head_dim" in config or lookup(config, "head_dim", names)[1] is not None:
        # NOTE: a config that holds no head_dim key at all derives it (hidden / heads =
        # head_dim above), and some classes make it a read-only property (FalconConfig), so
        # none is written there; a key present as None (hunyuan) is the model's to fill
        _put(new, config, "head_dim", head_dim, names)
    shrunk_counts = {"num_attention_heads": NUM_HEADS, "num_key_value_heads": kv}
    for key, model_wide in PER_LAYER_HEAD_KEYS.items():
        if isinstance(new.get(key), list):
            # A per-layer count equal to the model-wide one follows it down (the analyzer
            # refuses counts that differ from it).
            wide = shrunk_counts[model_wide]
            new[key] = [wide if v == config.get(model_wide) else v for v in new[key]]
    if lookup(config, "intermediate_size", names)[1] is not None:
        _put(new, config, "intermediate_size", INTERMEDIATE_SIZE, names)
    elif "intermediate_size" in config:
        new["intermediate_size"] = INTERMEDIATE_SIZE
    _put(new, config, "vocab_size", VOCAB_SIZE, names)
    if shrink_window and isinstance(config.get("sliding_window"), int):
        new["sliding_window"] = min(config["sliding_window"], SLIDING_WINDOW)
    if isinstance(config.get("compress_rates"), dict) and isinstance(config.get("index_topk"), int):
        # compressed attention (DeepSeek-V4): the ratios stay (the operators take 4 / 128);
        # a top-k the prompts' compressed entries exceed, so the CSA indexer drops some
        new["index_topk"] = min(config["index_topk"], COMPRESSED_INDEX_TOPK)
        new["index_n_heads"] = min(int(config.get("index_n_heads") or 1), INDEX_N_HEADS)
    if isinstance(config.get("attention_chunk_size"), int):
        # chunks shorter than the prompts, so a query's chunk boundary is exercised (the
        # original builds its chunked masks from the same value)
        new["attention_chunk_size"] = min(config["attention_chunk_size"], ATTENTION_CHUNK)
    top_k = _largest_top_k(new)
    for key in _EXPERT_COUNT_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            # more experts than the router picks, so routing still selects
            new[key] = min(config[key], max(NUM_EXPERTS, top_k + 2))
            if "num_experts_per_tok" in config and not config["num_experts_per_tok"]:
                # Some library default configs (deepseek_v2) leave top-k unset, and the
                # model's own router cannot run without it: route to two experts.
                new["num_experts_per_tok"] = min(2, new[key])
    for key in ("n_group", "num_expert_group"):
        if config.get(key):
            # Grouped routing (DeepSeek-V3 style): one group holding every shrunk expert, so
            # the group's top-2 scores and the top-k within it are still taken.
            new[key] = 1
            new["topk_group"] = 1
    for key in _EXPERT_SIZE_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            new[key] = EXPERT_INTERMEDIATE_SIZE
        elif isinstance(new.get(key), list):
            # one width per layer (already cut to the kept layers)
            new[key] = [EXPERT_INTERMEDIATE_SIZE if _above(v, 0) else v for v in new[key]]
    new.update(_groups_dividing_heads(config, new))
    new.update(_linear_attention_sizes(config))
    new.update(_ssm_sizes(config, new))
    new.update(_hidden_multiples(config, new))
    if isinstance(config.get("mlp_only_layers"), list):
        new["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    for offset, key in enumerate(_TOKEN_ID_KEYS, start=1):
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, int) and i >= VOCAB_SIZE for i in ids):
            # Past the shrunk vocabulary: moved to its end (some config classes require an
            # int); verify ignores EOS, so which token they name does not matter.
            fitted = [
                VOCAB_SIZE - offset if isinstance(i, int) and i >= VOCAB_SIZE else i for i in ids
            ]
            new[key] = fitted if isinstance(value, list) else fitted[0]
    if is_mla_config(config):
        # Latent attention: rope 64 and the latent (query D) at 512/128, the fused MLA
        # operator's limits (shrink_mla.py).
        new.update(shrink_mla(config, new, names))
    changes = {k: (config.get(k), v) for k, v in new.items() if config.get(k) != v}
    return ShrinkResult(config=new, changes=changes)
