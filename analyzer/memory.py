"""KV memory: bytes per token per layer kind, and blocks / tokens for a memory budget.

Per-token groups (FullAttention) grow with every token; a SlidingWindow layer holds at most
``ceil((W - 1) / block_size) + 1`` blocks per request; a Mamba layer holds one fixed state per
request. All sizes are per attention-TP rank.
"""

from __future__ import annotations

import math
from typing import Any

from kvskill.analyzer.config import ModelSpec, text_config
from kvskill.analyzer.plan import CacheEntryPlan
from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import block_bytes, entry_bytes, token_bytes
from kvskill.core.cache_bytes import dtype_bytes as element_bytes
from kvskill.core.kv_blocks import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    NULL_BLOCKS_PER_POOL,
    GroupBlockCost,
    split_kv_budget,
    window_blocks_per_request,
)

GIB = 1 << 30
#: fraction of device memory usable by weights + KV (activations and workspace take the rest)
HBM_UTILISATION = 0.9


def bytes_per_token_by_type(
    cache_entries: dict[str, list[CacheEntryPlan]], layer_counts: dict[str, int], dtype_bytes: int
) -> dict[str, int]:
    """KV bytes one token adds, summed over all layers of each per-token attn_type (a
    compressed entry adds 1 / compress_ratio of its row per token)."""
    result: dict[str, int] = {}
    for attn_type, entries in cache_entries.items():
        if attn_type == AttnType.MAMBA.value:
            continue
        result[attn_type] = sum(
            token_bytes(_row_bytes(e, dtype_bytes), e.compress_ratio)
            * _num_layers(e, attn_type, layer_counts)
            for e in entries
        )
    return result


def _row_bytes(entry: CacheEntryPlan, dtype_bytes: int) -> int:
    return entry_bytes(int(entry.dim), entry.num_head, dtype_bytes)


def _num_layers(entry: CacheEntryPlan, attn_type: str, layer_counts: dict[str, int]) -> int:
    return entry.num_layers if entry.num_layers is not None else layer_counts.get(attn_type, 0)


def state_bytes_per_request(
    cache_entries: dict[str, list[CacheEntryPlan]], layer_counts: dict[str, int], dtype_bytes: int
) -> int:
    """Bytes of conv + recurrent state one request holds across all Mamba-type layers.

    ``dtype_bytes`` is the model's; an entry naming its own dtype (a float32 recurrent state
    of a bfloat16 model) is counted at that dtype's size.
    """
    entries = cache_entries.get(AttnType.MAMBA.value, [])
    per_layer = 0
    for entry in entries:
        size = element_bytes(entry.dtype, default=dtype_bytes)
        per_layer += entry_bytes(entry.dim, entry.num_head, size)
    return per_layer * layer_counts.get(AttnType.MAMBA.value, 0)


def estimate_weight_bytes(config: dict[str, Any], spec: ModelSpec) -> int:
    """A rough parameter count x dtype size (embeddings, attention, MLP or experts)."""
    cfg, _ = text_config(config)
    hidden = spec.hidden_size
    vocab = spec.vocab_size  # vocab_size, or a vendor's name for it (padded_vocab_size)
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    if spec.mla:
        m = spec.mla
        q_dim = spec.num_heads * (int(m["qk_nope_head_dim"] or 0) + int(m["qk_rope_head_dim"]))
        attn = hidden * q_dim + hidden * (int(m["kv_lora_rank"]) + int(m["qk_rope_head_dim"]))
        attn += (
            int(m["kv_lora_rank"])
            * spec.num_heads
            * (int(m["qk_nope_head_dim"] or 0) + int(m["v_head_dim"] or 0))
        )
        attn += spec.num_heads * int(m["v_head_dim"] or 0) * hidden
    else:
        q = spec.num_heads * spec.head_dim
        attn = 2 * hidden * q + hidden * spec.num_kv_heads * (spec.head_dim + spec.v_head_dim)
    experts = spec.num_experts
    if experts:
        inner = cfg.get("moe_intermediate_size") or spec.intermediate_size or 0
        if isinstance(inner, list):
            # one expert width per layer (Hunyuan): the mean layer's, times the layers below
            widths = [int(v) for v in inner if isinstance(v, (int, float))]
            inner = sum(widths) / len(widths) if widths else 0
        mlp = int(experts * 3 * hidden * inner)
    else:
        mlp = 3 * hidden * (spec.intermediate_size or 4 * hidden)
    return (embed + spec.num_layers * (attn + mlp)) * spec.dtype_bytes


def plan_memory(
    *,
    spec: ModelSpec,
    config: dict[str, Any],
    cache_entries: dict[str, list[CacheEntryPlan]],
    layer_counts: dict[str, int],
    block_size: int,
    kv_memory_bytes: int | None,
    hbm_gb: float | None,
    legacy_row_tokens: int | None = None,
) -> dict[str, Any]:
    """Per-token and per-request costs; with a budget, blocks and max tokens in flight.

    ``legacy_row_tokens``: a Legacy model's static row (``max_model_len``); every layer, the
    sliding ones too, keeps a whole row per request, so the row is the cost of a request.
    """
    dtype_bytes = spec.dtype_bytes
    per_token = bytes_per_token_by_type(cache_entries, layer_counts, dtype_bytes)
    state = state_bytes_per_request(cache_entries, layer_counts, dtype_bytes)
    window = spec.sliding_window or 0
    sliding_bytes = per_token.get(AttnType.SLIDING_WINDOW.value, 0)
    sliding_blocks = math.ceil((window - 1) / block_size) + 1 if window and sliding_bytes else 0
    plan: dict[str, Any] = {
        "block_size": block_size,
        "dtype": spec.dtype,
        "bytes_per_token": per_token,
        "sliding_blocks_per_request": sliding_blocks,
        "sliding_bytes_per_request": sliding_blocks * block_size * sliding_bytes,
        "state_bytes_per_request": state,
    }
    if legacy_row_tokens:
        plan["legacy_row_tokens"] = legacy_row_tokens
        plan["legacy_bytes_per_request"] = legacy_row_tokens * sum(per_token.values())
    budget, budget_source = _budget(spec, config, kv_memory_bytes, hbm_gb, plan)
    if budget is None:
        return plan
    plan["kv_memory_bytes"] = budget
    plan["kv_memory_source"] = budget_source
    if legacy_row_tokens:
        # one block of the Legacy pool is one request's row
        costs = [
            GroupBlockCost(
                key=AttnType.LEGACY.value,
                bytes_per_block=plan["legacy_bytes_per_request"],
                max_blocks_per_request=None,
            )
        ]
    else:
        costs = _group_costs(cache_entries, layer_counts, dtype_bytes, state, window, block_size)
    plan.update(_blocks_for_budget(costs, budget, legacy_row_tokens or block_size))
    if legacy_row_tokens:
        plan["max_requests"] = max(plan["num_blocks"] - NULL_BLOCKS_PER_POOL, 0)
        return plan
    fixed_per_request = plan["sliding_bytes_per_request"] + state
    all_per_token = sum(per_token.values())
    if fixed_per_request:
        plan["max_requests_short"] = budget // fixed_per_request
    if all_per_token:
        plan["max_tokens_without_window_bound"] = budget // all_per_token
    return plan


def _group_costs(
    cache_entries: dict[str, list[CacheEntryPlan]],
    layer_counts: dict[str, int],
    dtype_bytes: int,
    state: int,
    window: int | None,
    block_size: int,
) -> list[GroupBlockCost]:
    """The cache groups ``kvskill run`` builds for this model (contiguous layout), priced.

    Entries group by ``manager_key`` or attn_type, as the runtime groups them; a block of a
    compressed entry holds ``block_size // compress_ratio`` rows. A window group holds what
    one step of ``DEFAULT_MAX_NUM_BATCHED_TOKENS`` new tokens can add to its window, as the
    runtime's sliding-window manager reserves; a state group one row per request.
    """
    block_cost: dict[tuple[str, str], int] = {}
    for attn_type, entries in cache_entries.items():
        if attn_type == AttnType.MAMBA.value:
            continue
        for e in entries:
            key = (e.manager_key or attn_type, attn_type)
            cost = block_bytes(_row_bytes(e, dtype_bytes), block_size, e.compress_ratio)
            block_cost[key] = block_cost.get(key, 0) + cost * _num_layers(
                e, attn_type, layer_counts
            )
    costs = []
    for (key, attn_type), bytes_per_block in block_cost.items():
        if not bytes_per_block:
            continue  # every layer of the type reads another's cache: no group of its own
        bound = None
        if attn_type == AttnType.SLIDING_WINDOW.value:
            bound = window_blocks_per_request(
                sliding_window=window or None,
                block_size=block_size,
                max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS,
            )
        costs.append(
            GroupBlockCost(key=key, bytes_per_block=bytes_per_block, max_blocks_per_request=bound)
        )
    if state:
        costs.append(
            GroupBlockCost(
                key=AttnType.MAMBA.value, bytes_per_block=state, max_blocks_per_request=1
            )
        )
    return costs


def _blocks_for_budget(costs: list[GroupBlockCost], budget: int, tokens_per_block: int) -> dict:
    """The plan's block keys: what ``kvskill run --kv-memory`` allocates with its defaults."""
    split = split_kv_budget(costs, budget_bytes=budget, max_num_seqs=DEFAULT_MAX_NUM_SEQS)
    growing = split.growing_keys
    by_group = split.num_blocks
    num_blocks = by_group[growing[0]] if growing else max(by_group.values(), default=0)
    usable = max(num_blocks - NULL_BLOCKS_PER_POOL, 0)
    return {
        "layout": "contiguous",
        "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
        "max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "num_blocks_by_group": by_group,
        "reserved_groups": list(split.reserved_keys),
        "reserved_bytes": split.reserved_bytes,
        "null_blocks": NULL_BLOCKS_PER_POOL * len(by_group),
        "budget_fits": split.fits,
        # one pool per growing group, all of the same size (null included); else the largest
        "num_blocks": num_blocks,
        # window/state only: memory bounds requests, not length
        "max_tokens": usable * tokens_per_block if growing else None,
    }


def _budget(
    spec: ModelSpec,
    config: dict[str, Any],
    kv_memory_bytes: int | None,
    hbm_gb: float | None,
    plan: dict[str, Any],
) -> tuple[int | None, str]:
    if kv_memory_bytes is not None:
        return int(kv_memory_bytes), "flag --kv-memory"
    if hbm_gb is None:
        return None, ""
    weights = estimate_weight_bytes(config, spec)
    plan["weight_bytes_estimate"] = weights
    budget = int(hbm_gb * GIB * HBM_UTILISATION) - weights
    return max(budget, 0), (
        f"--hbm-gb {hbm_gb:g} x {HBM_UTILISATION} minus ~{weights / GIB:.2f} GiB of weights "
        "(estimate: the whole model on one device)"
    )


def parse_memory(text: str | None) -> int | None:
    """'8GiB', '512M', '1.5GB', '1000000' -> bytes (``kvskill.core.sizes``: one parser for
    every verb; K/M/G/T and KiB/MiB/GiB/TiB binary, KB/MB/GB/TB decimal)."""
    from kvskill.core.sizes import parse_size

    return parse_size(text, option="--kv-memory")
