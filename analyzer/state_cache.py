"""The Plan's ``state_cache``: what a model's recurrent-state layers keep per request.

For a model with state (Mamba group) layers the Plan lists each such layer's mixer kind
(``gated_delta``, ``mamba1``, ``mamba2``, ``short_conv``), every state with its shape, its
own dtype (``pinned`` when the model fixes it: ``config.pinned_state_dtypes``) and bytes, the
bytes one request holds per layer and over all state layers, and the page size a pool shared
with attention layers would use: the attention block size grows in kernel blocks until an
attention page holds a state page (seed 004), the smaller payload padded up to the page
(padding skipped by strides, never copied).
"""

from __future__ import annotations

from typing import Any

from kvskill.analyzer.config import ModelSpec, pinned_state_dtypes
from kvskill.analyzer.plan import CacheEntryPlan, LayerPlan
from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import dtype_bytes, entry_bytes, hybrid_block_size

#: the operator's paged block (tokens) the attention block size is a multiple of
KERNEL_BLOCK_SIZE = 16


def mixer_kind(state: dict[str, Any]) -> str:
    """The state mixer the config's state dimensions describe."""
    return str(state.get("mixer", "mamba2" if state.get("num_state_heads", 0) > 1 else "mamba1"))


def state_cache(
    spec: ModelSpec, layers: list[LayerPlan], entries: dict[str, list[CacheEntryPlan]]
) -> dict[str, Any]:
    """The ``state_cache`` summary, or {} for a model without state layers."""
    states = entries.get(AttnType.MAMBA.value) or []
    state_layers = [layer.index for layer in layers if layer.attn_type == AttnType.MAMBA.value]
    if not states or not state_layers:
        return {}
    pinned = pinned_state_dtypes(spec.state)
    rows = []
    for entry in states:
        shape = [entry.dim] if isinstance(entry.dim, int) else list(entry.dim)
        if entry.num_head > 1:
            shape = [entry.num_head, *shape]
        size = entry_bytes(shape, 1, dtype_bytes(entry.dtype, 2))
        rows.append(
            {
                "cache_name": entry.cache_name,
                "shape": shape,
                "dtype": entry.dtype,
                "bytes": size,
                # the model fixes this dtype whatever the weights' dtype (the converted layer
                # pins it); an unpinned state follows the dtype the model runs in
                "pinned": entry.cache_name in pinned,
            }
        )
    # each state starts at a multiple of its own element size inside the page
    per_layer = 0
    for row in rows:
        item = dtype_bytes(row["dtype"], 2)
        per_layer = -(-per_layer // item) * item + row["bytes"]
    attention = [
        e for kind, group in entries.items() if kind != AttnType.MAMBA.value for e in group
    ]
    page: dict[str, Any] = {"state_page_bytes": per_layer}
    if attention:
        per_token = sum(entry_bytes(e.dim, e.num_head, dtype_bytes(e.dtype, 2)) for e in attention)
        block = hybrid_block_size(per_token, per_layer, KERNEL_BLOCK_SIZE)
        size = max(block * per_token, per_layer)
        page.update(
            attention_block_size=block,
            attention_bytes_per_token=per_token,
            page_size_bytes=size,
            state_padding_fraction=round(1 - per_layer / size, 6),
        )
    else:
        # state groups alone: one page is one request's state of one layer
        page.update(
            attention_block_size=None, page_size_bytes=per_layer, state_padding_fraction=0.0
        )
    return {
        "layers": [{"index": i, "mixer": mixer_kind(spec.state)} for i in state_layers],
        "states": rows,
        "bytes_per_request_per_layer": per_layer,
        "bytes_per_request": per_layer * len(state_layers),
        "page": page,
    }


__all__ = ["KERNEL_BLOCK_SIZE", "mixer_kind", "state_cache"]
