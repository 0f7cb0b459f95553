"""The executor's cache-declaration contract, as the lint rules check it.

Facts read from hicann/cann-recipes-infer at ``fbc225d`` (``executor/core/kv_cache/
cache_info.py`` and ``validate_cache_info`` in ``cache_utils.py``); kvskill's bundled runtime
declares the same fields, so one converted file runs in either host. Only names and
allowed values live here; the rules decide what is statically visible.
"""

from __future__ import annotations

import libcst as cst

#: ``CacheEntry`` fields in declaration (positional) order; ``needs_block`` has no default
CACHE_ENTRY_FIELDS = (
    "cache_name",
    "attn_type",
    "dim",
    "num_head",
    "dtype",
    "needs_block",
    "block_size",
    "manager_key",
    "tensor_setter",
    "sliding_window",
    "allocator",
    "compress_ratio",
    "tensor",
    "cache_layout",
)
CACHE_ENTRY_REQUIRED = ("cache_name", "attn_type", "dim", "num_head", "dtype", "needs_block")
#: ``MambaCacheEntry`` adds these; it is built with keywords only (its overridden fields are
#: keyword-only, which shifts the positional order away from ``CacheEntry``'s)
MAMBA_ONLY_FIELDS = ("shape", "next_n")
MAMBA_REQUIRED = ("cache_name", "dtype", "needs_block")
#: ``ModelCacheInfo(num_layers, layer_infos, is_mla_backend=False)``: no ``block_size`` since
#: June 2026; each entry carries its own
MODEL_CACHE_INFO_FIELDS = ("num_layers", "layer_infos", "is_mla_backend")
MODEL_CACHE_INFO_REQUIRED = ("num_layers", "layer_infos")

SUPPORTED_CACHE_LAYOUTS = frozenset({"BnBsND", "BnNBsD"})
SUPPORTED_ALLOCATORS = frozenset({"hbm", "swapped_memory"})
#: attn types validate_cache_info has a per-token rule for (Mamba needs a MambaCacheEntry)
TOKEN_ATTN_TYPES = frozenset({"FullAttention", "SlidingWindow"})

#: the fix every "give the entry its block size" finding suggests
ENTRY_BLOCK_FIX = (
    "needs_block=True, block_size=self.block_size with self.block_size = "
    "infer_config.scheduler_config.block_size (the runtime's block size)"
)


def callee_name(call: cst.Call) -> str:
    """``CacheEntry`` for ``CacheEntry(...)`` and ``kv_cache.CacheEntry(...)``, else the
    callee's last name (``""`` for anything else)."""
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    return ""


def bind_arguments(
    call: cst.Call, fields: tuple[str, ...]
) -> tuple[dict[str, cst.BaseExpression], list[cst.Arg]]:
    """The call's arguments by field name (positional ones in ``fields`` order), and the
    arguments that match no field (keywords the class lacks, positionals past the end)."""
    bound: dict[str, cst.BaseExpression] = {}
    unknown: list[cst.Arg] = []
    positional = [a for a in call.args if a.keyword is None and not a.star]
    for index, arg in enumerate(positional):
        if index < len(fields):
            bound[fields[index]] = arg.value
        else:
            unknown.append(arg)
    for arg in call.args:
        if arg.keyword is None:
            continue
        if arg.keyword.value in fields:
            bound[arg.keyword.value] = arg.value
        else:
            unknown.append(arg)
    return bound, unknown


def has_star(call: cst.Call) -> bool:
    """``*args`` or ``**kwargs`` given: any field may be hidden in them."""
    return any(a.star for a in call.args)
