"""Config values checked against the model's own invariants before anything is sized.

A config is user input: ``hidden_size=0`` or a negative head count would build a model that
computes nonsense (and verify would compare nonsense with nonsense), and
``num_hidden_layers=10**9`` would be counted, listed or allocated until the kernel kills the
process. ``check_config_values`` refuses such values with the key and the allowed range, and
``estimate_num_params`` sizes the model by arithmetic (no allocation, not even on the meta
device) so callers can refuse it before building it.
"""

from __future__ import annotations

import math
from typing import Any

from kvskill.core.errors import BadInputError

#: key -> (smallest, largest) allowed value; first key of each tuple row is what is reported
_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 10_000),
    "n_layer": (1, 10_000),
    "num_layers": (1, 10_000),
    "n_layers": (1, 10_000),
    "hidden_size": (1, 1 << 20),
    "n_embd": (1, 1 << 20),
    "d_model": (1, 1 << 20),
    "num_attention_heads": (1, 1 << 16),
    "n_head": (1, 1 << 16),
    "num_key_value_heads": (1, 1 << 16),
    "num_kv_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16),
    "vocab_size": (1, 1 << 26),
    "intermediate_size": (0, 1 << 24),
    "moe_intermediate_size": (0, 1 << 24),
    "max_position_embeddings": (1, 1 << 30),
    "kv_lora_rank": (1, 1 << 16),
    "q_lora_rank": (1, 1 << 16),
    "qk_rope_head_dim": (0, 1 << 16),
    "qk_nope_head_dim": (0, 1 << 16),
    "v_head_dim": (1, 1 << 16),
    "num_experts": (0, 1 << 16),
    "n_routed_experts": (0, 1 << 16),
    "num_local_experts": (0, 1 << 16),
    "num_experts_per_tok": (0, 1 << 16),
    "sliding_window": (0, 1 << 30),
}

#: keys a config may give once per layer instead of once (Hunyuan's MoE lists): a list of
#: such values is checked value by value against the same bounds
PER_LAYER_KEYS = frozenset(
    {"moe_intermediate_size", "intermediate_size", "num_experts_per_tok", "moe_topk"}
)
#: per-layer MoE keys with no bound of their own: each value a count (shared experts may be 0)
_PER_LAYER_COUNTS: dict[str, tuple[int, int]] = {
    "moe_topk": (0, 1 << 16),
    "num_shared_expert": (0, 1 << 16),
}

#: first key present wins, as in the analyzer's normalisation
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")


def decoder_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The decoder's part of a config: ``text_config`` of a composite config, else itself.

    A checkpoint may store its text keys at the top level (dots3_note's published
    ``config.json``); its config class builds ``text_config`` from them and keeps them at the
    top level too. Both then name the same layer count, and ``text_config`` is the one the
    model reads, with the values the class derives (``per_layer_config``, normalised
    ``layer_types``).
    """
    inner = config.get("text_config")
    if isinstance(inner, dict) and (
        "num_hidden_layers" not in config
        or inner.get("num_hidden_layers") == config["num_hidden_layers"]
    ):
        return inner, "text_config."
    return config, ""


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return None, None


def check_config_values(config: dict[str, Any], *, where: str) -> None:
    """Refuse sizes a model cannot have: non-integers, zero or negative counts, absurdly large
    values, and head counts that do not divide as attention needs.

    Raises:
        BadInputError: naming ``where``, the key, the value and what is allowed.
    """
    cfg, prefix = decoder_config(config)
    for key, (low, high) in {**_PER_LAYER_COUNTS, **_BOUNDS}.items():
        value = cfg.get(key)
        if value is None or (key == "head_dim" and value == 0 and _ropeless_latent(cfg)):
            continue
        if isinstance(value, list) and key in PER_LAYER_KEYS | _PER_LAYER_COUNTS.keys():
            for index, item in enumerate(value):
                _check_count(f"{prefix}{key}[{index}]", item, low, high, where=where)
        else:
            _check_count(f"{prefix}{key}", value, low, high, where=where)
    heads_key, heads = _first(cfg, _HEADS)
    kv_key, kv_heads = _first(cfg, _KV_HEADS)
    if cfg.get("multi_query") is True and not cfg.get("new_decoder_architecture"):
        # falcon: multi_query means one KV head; num_kv_heads counts only in the new
        # decoder architecture (analyzer.config_keys.kv_heads reads the same flags)
        kv_heads = 1
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise BadInputError(
            f"{where}: {prefix}{heads_key}={heads} is not a multiple of "
            f"{prefix}{kv_key}={kv_heads}; each KV head serves a whole group of query heads"
        )
    hidden_key, hidden = _first(cfg, _HIDDEN)
    if (
        isinstance(hidden, int)
        and isinstance(heads, int)
        and cfg.get("head_dim") is None
        and hidden < heads
    ):
        raise BadInputError(
            f"{where}: {prefix}{hidden_key}={hidden} is smaller than {prefix}{heads_key}={heads} "
            "and no head_dim is given: the heads would be empty"
        )


def _ropeless_latent(cfg: dict[str, Any]) -> bool:
    """An MLA latent without a rope key (glm5_next): its config ties ``head_dim`` to
    ``qk_rope_head_dim``, so both are 0 in a saved config.json."""
    return bool(cfg.get("kv_lora_rank")) and cfg.get("qk_rope_head_dim") == 0


def _check_count(name: str, value: Any, low: int, high: int, *, where: str) -> None:
    """Refuse a value of NAME that is not an integer in ``low..high``."""
    shown = value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInputError(f"{where}: {name} must be an integer, got {shown!r}")
    if not low <= value <= high:
        raise BadInputError(
            f"{where}: {name}={value} is outside what a model can have ({low}..{high})"
        )


def check_tp_split(num_heads: int, num_kv_heads: int, attn_tp_size: int, *, mla: bool) -> None:
    """Attention tensor parallelism splits query heads evenly, and KV heads evenly or by
    replication (fewer KV heads than ranks: each rank keeps one, as the seeds' formula
    ``max(num_kv_heads // attn_tp_size, 1)`` assumes). MLA's latent cache is not split.

    Raises:
        BadInputError: the split leaves ranks with unequal or no heads.
    """
    if attn_tp_size == 1:
        return
    if num_heads % attn_tp_size:
        raise BadInputError(
            f"--attn-tp-size {attn_tp_size} does not divide the {num_heads} attention heads; "
            f"use a divisor of {num_heads} ({_divisors(num_heads)})"
        )
    if mla or num_kv_heads <= 0:
        return
    if num_kv_heads % attn_tp_size and attn_tp_size % num_kv_heads:
        raise BadInputError(
            f"--attn-tp-size {attn_tp_size} neither divides the {num_kv_heads} KV heads nor is a "
            f"multiple of them; use one of {_divisors(num_heads)} that does"
        )


def _divisors(n: int) -> str:
    found = [d for d in range(1, min(n, 1 << 12) + 1) if n % d == 0]
    return ", ".join(map(str, found[:12])) + (" ..." if len(found) > 12 else "")


def estimate_num_params(config: dict[str, Any]) -> int | None:
    """A rough parameter count from the config alone (attention, MLP or experts, embeddings),
    or None when the config does not name its sizes. Meant to refuse configs orders of
    magnitude too large before building anything; it is not exact."""
    cfg, _ = decoder_config(config)
    _, layers = _first(cfg, _LAYERS)
    _, hidden = _first(cfg, _HIDDEN)
    if not isinstance(layers, int) or not isinstance(hidden, int):
        return None
    _, heads = _first(cfg, _HEADS)
    heads = heads if isinstance(heads, int) and heads > 0 else 1
    _, kv_heads = _first(cfg, _KV_HEADS)
    kv_heads = kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads
    head_dim = cfg.get("head_dim") if isinstance(cfg.get("head_dim"), int) else hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    inter = _widest(cfg.get("intermediate_size"))
    _, experts = _first(cfg, ("num_experts", "n_routed_experts", "num_local_experts"))
    moe_inter = _widest(cfg.get("moe_intermediate_size")) or None
    mlp = 3 * hidden * inter
    if isinstance(experts, int) and experts > 0:
        mlp = max(mlp, 3 * hidden * (moe_inter if isinstance(moe_inter, int) else inter) * experts)
    vocab = cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else 0
    return layers * (attention + mlp) + 2 * vocab * hidden


def _widest(value: Any) -> int:
    """An int width, or the widest of a per-layer list of them; 0 when neither."""
    values = value if isinstance(value, list) else [value]
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return max(ints, default=0)


def format_bytes(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB at most): a small
    model's 48 KiB pool must not read as "0.00 GiB"."""
    if not math.isfinite(num_bytes):
        return str(num_bytes)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"
