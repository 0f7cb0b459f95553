"""The structural check of a built converted model: each cache holds what its forward writes.

A cache entry declares ``num_head`` heads of ``dim`` channels per token; the converted forward
writes the key (value) its projection produced, reshaped to ``[T, num_head, -1]``. When the
two disagree (a cache sized from a config key the attention does not read: 8 heads declared,
2 projected), the runtime's scatter fails on a shape, or on hardware writes the wrong slots.
This check compares them on the built module, before anything runs, and refuses the
conversion (exit 3) naming the class.

Worked example (``query_groups_bhsd``: 2 KV heads of 16, ``attn_tp_size`` 1)::

    k_proj.out_features = 32  ->  32 // 16 = 2 heads  ->  per rank max(2 // 1, 1) = 2
    k_cache: num_head 2, dim 16                            ok
    k_cache: num_head 8, dim 16  (sized from num_attention_heads)   refused

A fused projection (``wqkv``) must be as wide as the queries plus both caches:
``num_heads_per_rank * tp * dim + tp * num_head * (dim_k + dim_v)``.
"""

from __future__ import annotations

from typing import Any

from kvskill.analyzer.kv_sizing import FUSED_PROJECTIONS, KEY_PROJECTIONS, VALUE_PROJECTIONS
from kvskill.core.errors import UnsupportedModelError

#: the per-token caches this check reads (latent and state caches have no such projection)
_KV_CACHES = {"k_cache": KEY_PROJECTIONS, "v_cache": VALUE_PROJECTIONS}


def _out_features(module: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        width = getattr(getattr(module, name, None), "out_features", None)
        if isinstance(width, int):
            return name, width
    return None


def width_problem(module: Any) -> str | None:
    """Why MODULE's declared k/v caches do not hold what its projections produce, or None
    (also when it has no such caches or no recognised projection)."""
    entries = {e.cache_name: e for e in getattr(module, "cache_entries", None) or []}
    if not set(_KV_CACHES) <= entries.keys():
        return None
    tp = int(getattr(module, "attn_tp_size", 1) or 1)
    for cache_name, names in _KV_CACHES.items():
        found = _out_features(module, names)
        if found is None:
            continue
        attr, width = found
        entry = entries[cache_name]
        if width % entry.dim or max(width // entry.dim // tp, 1) != entry.num_head:
            return (
                f"{cache_name} holds {entry.num_head} heads x {entry.dim} per rank (attn_tp_size "
                f"{tp}) but {attr} writes {width} channels per token"
            )
    fused = _out_features(module, FUSED_PROJECTIONS)
    heads = getattr(module, "num_heads_per_rank", None)
    if (
        fused is not None
        and isinstance(heads, int)
        and _out_features(module, KEY_PROJECTIONS) is None
    ):
        attr, width = fused
        k, v = entries["k_cache"], entries["v_cache"]
        expected = heads * tp * k.dim + tp * (k.num_head * k.dim + v.num_head * v.dim)
        if width != expected:
            return (
                f"{heads * tp} query heads and caches of {k.num_head} x {k.dim} (k) and "
                f"{v.num_head} x {v.dim} (v) per rank make {expected} channels, but {attr} "
                f"writes {width}"
            )
    return None


def check_cache_widths(model: Any) -> None:
    """Refuse a converted model one of whose attention modules declares caches of another
    width than its projections write.

    Raises:
        UnsupportedModelError: naming the class and both widths.
    """
    for name, module in model.named_modules():
        problem = width_problem(module)
        if problem is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} ({name}): the converted caches do not match the "
                f"attention: {problem}; the conversion sized them wrongly, so nothing is run"
            )
