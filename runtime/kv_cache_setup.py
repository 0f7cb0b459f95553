"""Give a loaded model its KV cache: the budget, the block count per group, the tensors.

``prepare_kv_cache`` asks the model for its cache declarations (``get_cache_info()``),
sizes the pools from a block count or a byte budget (by default a share of free memory, see
``default_kv_memory_bytes``) and has ``KVCacheManager`` allocate and inject the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvskill.core.config_checks import format_bytes
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.runtime.cache_info import ModelCacheInfo
from kvskill.runtime.device import available_memory_bytes
from kvskill.runtime.kv_cache_groups import build_groups
from kvskill.runtime.kv_cache_manager import KVCacheManager
from kvskill.runtime.managers import FIXED_BLOCK_ATTN_TYPES
from torch import nn

#: KV budget when neither a block count nor a budget is given: a share of free memory
DEFAULT_KV_MEMORY_FRACTION = 0.1
DEFAULT_KV_MEMORY_CAP_BYTES = 4 << 30


@dataclass(slots=True)
class KVCacheSetup:
    cache_info: ModelCacheInfo
    manager: KVCacheManager


def prepare_kv_cache(
    model: nn.Module,
    *,
    device: torch.device,
    block_size: int | None = None,
    num_blocks: int | None = None,
    kv_memory_bytes: int | None = None,
    free_block_order_seed: int | None = None,
    use_hybrid_blocks: bool = False,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    log_layout: bool = False,
) -> KVCacheSetup:
    """Ask the model for its cache declarations, size the pools and inject the tensors.

    Args:
        block_size: overrides the model's default tokens per block (entries that set their
            own block size keep it).
        num_blocks / kv_memory_bytes: size of each pool in blocks (null block included), or
            a byte budget; with neither, see ``default_kv_memory_bytes``.
        max_model_len: longest request expected; only sizes the default budget.
        log_layout: log every cache view built (``[non-contiguous-kv-cache]`` lines).

    Raises:
        UnsupportedModelError: the model has no ``get_cache_info``.
        BadInputError: inconsistent cache declarations or a budget below two blocks.
    """
    get_cache_info = getattr(model, "get_cache_info", None)
    if not callable(get_cache_info):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no get_cache_info(); it is not a converted model"
        )
    if block_size is not None:
        if block_size < 1:
            raise BadInputError(f"block_size must be >= 1, got {block_size}")
        if hasattr(model, "block_size"):
            model.block_size = block_size
    info = get_cache_info()
    if not isinstance(info, ModelCacheInfo):
        raise BadInputError(
            f"{type(model).__name__}.get_cache_info() returned {type(info).__name__}; "
            "expected kvskill.runtime.ModelCacheInfo"
        )
    if block_size is not None and info.block_size != block_size:
        info = ModelCacheInfo(
            num_layers=info.num_layers,
            block_size=block_size,
            layer_infos=info.layer_infos,
            is_mla_backend=info.is_mla_backend,
        )
    if num_blocks is None and kv_memory_bytes is None:
        kv_memory_bytes = default_kv_memory_bytes(
            info,
            device,
            max_num_seqs=max_num_seqs or 1,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
    _check_kv_fits(info, device, num_blocks=num_blocks, kv_memory_bytes=kv_memory_bytes)
    manager = KVCacheManager(
        info,
        num_blocks=num_blocks,
        memory_budget_bytes=None if num_blocks is not None else kv_memory_bytes,
        device=str(device),
        use_hybrid_blocks=use_hybrid_blocks,
        free_block_order_seed=free_block_order_seed,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    manager.allocate_cache_tensors(log_layout=log_layout)
    return KVCacheSetup(info, manager)


def _check_kv_fits(
    info: ModelCacheInfo,
    device: torch.device,
    *,
    num_blocks: int | None,
    kv_memory_bytes: int | None,
) -> None:
    """Refuse a KV cache larger than the device's free memory before any pool is built."""
    if num_blocks is not None:
        if num_blocks < 2:
            raise BadInputError(
                f"num_blocks must be >= 2 (one is the null block), got {num_blocks}"
            )
        need = num_blocks * sum(g.bytes_per_block() for g in build_groups(info).values())
        what = f"{num_blocks} blocks"
    elif kv_memory_bytes is not None:
        if kv_memory_bytes < 1:
            raise BadInputError(f"the KV memory budget must be positive, got {kv_memory_bytes}")
        need, what = kv_memory_bytes, "the KV memory budget"
    else:
        return
    free = available_memory_bytes(device)
    if free is not None and need > free:
        raise BadInputError(
            f"{what} would take {format_bytes(need)} but only {format_bytes(free)} is free on "
            f"{device}; give fewer blocks or a smaller --kv-memory"
        )


def default_kv_memory_bytes(
    info: ModelCacheInfo,
    device: torch.device,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    max_model_len: int | None,
) -> int:
    """KV bytes for ``max_num_seqs`` requests of ``max_model_len`` tokens (4096 if unknown),
    capped at a tenth of the device's free memory and at 4 GiB.

    NOTE: sized by need first so a tiny model does not zero-fill gigabytes of host memory.
    Fixed-block groups (windows, states) get what the budget rule reserves for them.
    """
    from kvskill.runtime.layout import calculate_fixed_block_num

    wanted = 0
    for group in build_groups(info).values():
        fixed = calculate_fixed_block_num(
            group, max_num_seqs, max_num_batched_tokens, FIXED_BLOCK_ATTN_TYPES
        )
        if fixed is None:
            blocks = max_num_seqs * -(-(max_model_len or 4096) // group.block_size) + 1
            wanted += blocks * group.bytes_per_block()
        else:
            wanted += fixed * group.bytes_per_block()
    free = available_memory_bytes(device) or DEFAULT_KV_MEMORY_CAP_BYTES
    return max(1, min(wanted, int(free * DEFAULT_KV_MEMORY_FRACTION), DEFAULT_KV_MEMORY_CAP_BYTES))
