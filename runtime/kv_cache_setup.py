"""Give a loaded model its KV cache: the budget, the block count per group, the tensors.

``prepare_kv_cache`` asks the model for its cache declarations (``get_cache_info()``),
sizes the pools from a block count or a byte budget (by default what the expected requests
need, capped by a share of the device's total memory, see ``default_kv_budget``) and has
``KVCacheManager`` allocate and inject the tensors. The rule that sized the pools is kept as
a ``KVBudget`` so ``run`` can say which budget it used and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvskill.core.attn_types import AttnType
from kvskill.core.config_checks import format_bytes
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.core.kv_blocks import NULL_BLOCKS_PER_POOL
from kvskill.runtime.cache_info import MambaCacheEntry, ModelCacheInfo, fill_block_sizes
from kvskill.runtime.device import available_memory_bytes, total_memory_bytes
from kvskill.runtime.kv_cache_groups import build_groups
from kvskill.runtime.kv_cache_manager import KVCacheManager
from kvskill.runtime.managers import FIXED_BLOCK_ATTN_TYPES
from torch import nn

#: KV budget when neither a block count nor a budget is given: what the expected requests
#: need, capped at a share of the device's TOTAL memory (free memory changes from run to run,
#: so a budget derived from it would not repeat) and at an absolute cap
DEFAULT_KV_MEMORY_FRACTION = 0.1
DEFAULT_KV_MEMORY_CAP_BYTES = 4 << 30
#: tokens per request assumed by the default budget when no max_model_len is given
DEFAULT_BUDGET_MODEL_LEN = 4096
#: tokens per block of a model that names none (the fused attention's usual paged size)
DEFAULT_BLOCK_SIZE = 128


@dataclass(frozen=True, slots=True)
class KVBudget:
    """Which rule sized the KV pools, with its numbers (``run`` prints it)."""

    #: "num_blocks" (blocks per cache group, given), "kv_memory" (bytes, given) or "default"
    rule: str
    #: blocks per cache group when given, else None
    num_blocks: int | None
    #: the byte budget split across the groups, else None
    kv_memory_bytes: int | None
    #: one line: where the numbers came from
    reason: str


@dataclass(slots=True)
class KVCacheSetup:
    cache_info: ModelCacheInfo
    manager: KVCacheManager
    budget: KVBudget


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
    enable_prefix_caching: bool = False,
    drafter: nn.Module | None = None,
    next_n: int = 0,
) -> KVCacheSetup:
    """Ask the model for its cache declarations, size the pools and inject the tensors.

    Args:
        block_size: overrides the model's default tokens per block (entries that set their
            own block size keep it).
        num_blocks / kv_memory_bytes: size of EACH cache group's pool in blocks (null block
            included), or one byte budget shared by the groups; with neither, see
            ``default_kv_budget``.
        max_model_len: longest request expected; only sizes the default budget.
        log_layout: log every cache view built (``[non-contiguous-kv-cache]`` lines).
        enable_prefix_caching: see ``KVCacheManager``.
        drafter: the MTP layers (``runtime/mtp.py``) when speculating: their cache info is
            merged after the model's (``ModelCacheInfo.merge``), so the same pools, block
            tables and slot mappings serve them.
        next_n: drafts per verify step when speculating: every Mamba entry declares it (its
            manager keeps ``1 + next_n`` state blocks per request, the framework's
            ``MambaCacheEntry.next_n``) and window groups keep ``2 * next_n`` more tokens.

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
    if drafter is not None:
        info = info.merge(drafter.get_cache_info())
    for _, entry in info.entries():
        if isinstance(entry, MambaCacheEntry):
            entry.next_n = next_n
    size_legacy_rows(info, max_model_len or DEFAULT_BUDGET_MODEL_LEN)
    # Entries that chose their block size keep it; the others take the run's.
    fill_block_sizes(info, block_size or getattr(model, "block_size", None) or DEFAULT_BLOCK_SIZE)
    if num_blocks is not None:
        budget = KVBudget(
            rule="num_blocks",
            num_blocks=num_blocks,
            kv_memory_bytes=None,
            reason=f"{num_blocks} blocks per cache group, as given",
        )
    elif kv_memory_bytes is not None:
        budget = KVBudget(
            rule="kv_memory",
            num_blocks=None,
            kv_memory_bytes=kv_memory_bytes,
            reason=f"{format_bytes(kv_memory_bytes)} as given",
        )
    else:
        budget = default_kv_budget(
            info,
            device,
            max_num_seqs=max_num_seqs or 1,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        kv_memory_bytes = budget.kv_memory_bytes
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
        enable_prefix_caching=enable_prefix_caching,
        next_n=next_n,
    )
    manager.allocate_cache_tensors(log_layout=log_layout)
    return KVCacheSetup(info, manager, budget)


def size_legacy_rows(info: ModelCacheInfo, max_model_len: int) -> None:
    """Give every Legacy entry without its own block size a block of MAX_MODEL_LEN tokens:
    one block is one request's static row, so the row must hold the longest request."""
    for _, entry in info.entries():
        if entry.attn_type == AttnType.LEGACY.value and entry.block_size is None:
            entry.block_size = max_model_len


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


def default_kv_budget(
    info: ModelCacheInfo,
    device: torch.device,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    max_model_len: int | None,
) -> KVBudget:
    """The byte budget when none is given: ``max_num_seqs`` requests of ``max_model_len``
    tokens (4096 if unknown), capped at a tenth of the device's total memory and at 4 GiB.

    A function of explicit settings and the machine only, so identical runs get identical
    pools. Fixed-block groups (windows, states) get what the budget rule reserves for them.

    NOTE: sized by need first so a tiny model does not zero-fill gigabytes of host memory.
    """
    from kvskill.runtime.layout import calculate_fixed_block_num

    model_len = max_model_len or DEFAULT_BUDGET_MODEL_LEN
    wanted = 0
    #: block size -> blocks one request of model_len tokens takes (rounded up to whole blocks)
    rounded: dict[int, int] = {}
    for group in build_groups(info).values():
        fixed = calculate_fixed_block_num(
            group, max_num_seqs, max_num_batched_tokens, FIXED_BLOCK_ATTN_TYPES
        )
        if fixed is None:
            rounded[group.block_size] = -(-model_len // group.block_size)
            blocks = max_num_seqs * rounded[group.block_size] + NULL_BLOCKS_PER_POOL
            wanted += blocks * group.bytes_per_block()
        else:
            wanted += fixed * group.bytes_per_block()
    total = total_memory_bytes(device)
    caps = [(DEFAULT_KV_MEMORY_CAP_BYTES, f"the {format_bytes(DEFAULT_KV_MEMORY_CAP_BYTES)} cap")]
    if total is not None:
        share = int(total * DEFAULT_KV_MEMORY_FRACTION)
        caps.append((share, f"{DEFAULT_KV_MEMORY_FRACTION:.0%} of {format_bytes(total)} total"))
    cap, cap_reason = min(caps)
    need = f"{max_num_seqs} requests x {model_len} tokens"
    if rounded:
        per_request = ", ".join(f"{n} block(s) of {size}" for size, n in sorted(rounded.items()))
        need += f" ({per_request} each)"
    if wanted <= cap:
        reason = f"default: {need} need {format_bytes(wanted)} (under {cap_reason})"
    else:
        reason = f"default: {need} need {format_bytes(wanted)}, capped at {cap_reason}"
    return KVBudget(
        rule="default",
        num_blocks=None,
        kv_memory_bytes=max(1, min(wanted, cap)),
        reason=reason,
    )
