"""Cache allocation: dense per-entry tensors, or one page-aligned pool with strided views.

Two paths behind one switch (``use_hybrid_blocks``):

* contiguous-compatible: one dense tensor per entry, ``[num_blocks, block_size, heads, *dim]``
  (Mamba: ``[num_blocks, *shape]``; a compressed entry: ``block_size // compress_ratio`` rows
  in place of ``block_size``), each group with its own block ids.
* page pool: one int8 allocation split into pages of ``page_size_bytes`` (the largest
  per-layer block payload of any group, rounded up to the alignment). The j-th layer of
  every group gets raw page view j, ``[num_blocks, page_size_bytes]``; all groups draw
  block ids from one shared pool, so a page is owned by one group at a time. Inside a page,
  the layer's entries sit at consecutive byte offsets (K lane, then V lane; conv state,
  then SSM state). Typed views step ``page_size_bytes / itemsize`` elements per block, so
  padding is skipped by the stride and never copied:

      page (128 B): [ payload 96 B = 48 fp16 | pad 32 B ]  -> block stride 64 elements

NOTE: a page view cannot be flattened to slots with ``cache.view(-1, heads, dim)`` (the
block stride is not ``block_size * heads * dim``); ``view`` raises instead of copying. Write
with ``(block, offset)`` indices ``stack([slot // bs, slot % bs], -1)`` into the 4-D view, or
use the contiguous layout. ``cache.view(num_blocks, block_size, -1)`` for the fused attention
works on both layouts. Whether the Ascend kernels accept these strided views for every path
is not confirmed on hardware here (see the ops reference, section 8).

With ``log_layout=True`` a build logs ``[non-contiguous-kv-cache]`` lines through the
``kvskill.runtime.layout`` logger. The switch is a parameter all the way down from
``LLM(..., log_layout=...)``; only the CLI maps ``KVSKILL_LOG_LAYOUT=1`` onto it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch
from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import hybrid_block_size
from kvskill.core.errors import BadInputError
from kvskill.core.kv_blocks import GroupBlockCost, reserved_pool_blocks, split_kv_budget
from kvskill.runtime import huge_pages
from kvskill.runtime.cache_info import CacheEntry, LayerCacheInfo, layer_binder
from kvskill.runtime.kv_cache_groups import KVCacheGroup
from kvskill.runtime.managers import ATTN_TYPE_MANAGER_MAP
from torch import Tensor

logger = logging.getLogger("kvskill.runtime.layout")
LOG_PREFIX = "[non-contiguous-kv-cache]"


def _route_layout_log() -> None:
    """Make sure the layout lines reach someone once a caller asked for them.

    The lines are INFO records; with no logging configured anywhere (a plain script or the
    CLI) they would be dropped, so a stderr handler is attached in that case only.
    """
    logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(logging.StreamHandler())  # stderr


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def entry_offsets(entries: list[CacheEntry], block_size: int) -> tuple[list[int], int]:
    """Byte offset of each entry inside a page (each aligned to its itemsize) and the end."""
    offsets, end = [], 0
    for entry in entries:
        end = _round_up(end, _itemsize(entry.dtype))
        offsets.append(end)
        end += entry.bytes_per_block(block_size)
    return offsets, end


def page_size_bytes(groups: Mapping[str, KVCacheGroup], alignment: int) -> int:
    """Largest per-layer block payload over all groups, rounded up to the alignment."""
    payload = max(
        entry_offsets(entries, g.block_size)[1] for g in groups.values() for _, entries in g.layers
    )
    # A page must also split evenly into elements of every dtype viewed through it.
    itemsizes = [_itemsize(e.dtype) for g in groups.values() for e in g.entries]
    return _round_up(payload, math.lcm(alignment, *itemsizes))


def strided_view(
    raw: Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset_bytes: int
) -> Tensor:
    """A typed ``[num_blocks, *shape]`` view of raw int8 pages ``[num_blocks, page_bytes]``.

    Block stride = page size in elements; the inner dims are dense. No copy: the result
    shares ``raw``'s storage and starts ``offset_bytes`` into each page.
    """
    num_blocks, page_bytes = raw.shape
    item = _itemsize(dtype)
    assert page_bytes % item == 0 and offset_bytes % item == 0, "page not aligned to dtype"
    assert offset_bytes + math.prod(shape) * item <= page_bytes, "view overruns its page"
    base = raw.view(-1).view(dtype)  # the raw view's elements, same storage
    inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    start = (raw.storage_offset() + offset_bytes) // item
    return torch.as_strided(base, (num_blocks, *shape), (page_bytes // item, *inner), start)


def kv_lane_view(
    raw: Tensor, dtype: torch.dtype, block_size: int, num_head: int, head_dim: int
) -> Tensor:
    """Combined K/V view ``(2, num_blocks, block_size, num_head, head_dim)`` of raw pages.

    Each page holds ``[K lane][V lane]``; the lane stride is one lane's payload and the block
    stride the physical page, both taken from the allocation, not from the logical size.
    """
    k = strided_view(raw, dtype, (block_size, num_head, head_dim), 0)
    lane = block_size * num_head * head_dim
    return torch.as_strided(k, (2, *k.shape), (lane, *k.stride()), k.storage_offset())


def split_page(raw: Tensor, entries: list[CacheEntry], block_size: int) -> dict[str, Tensor]:
    """Typed views of every entry of one layer, at consecutive byte offsets in its page."""
    offsets, _ = entry_offsets(entries, block_size)
    return {
        e.cache_name: strided_view(raw, e.dtype, e.block_shape(block_size), off)
        for e, off in zip(entries, offsets, strict=True)
    }


def bind_kv_cache(
    layer: LayerCacheInfo,
    storage: Tensor | dict[str, Tensor],
    entries: list[CacheEntry],
    block_size: int,
) -> dict[str, Tensor]:
    """Give a layer its storage: a raw page view (page pool) or dense tensors by name.

    The layer's own ``bind_kv_cache`` wins when it has one (it receives ``storage`` as is);
    otherwise each entry's ``tensor_setter`` gets its typed view.
    """
    views = storage if isinstance(storage, dict) else split_page(storage, entries, block_size)
    for entry in entries:
        entry.tensor = views[entry.cache_name]
    binder = layer_binder(layer)
    if binder is not None:
        binder(storage)
    else:
        for entry in entries:
            entry.tensor_setter(views[entry.cache_name])
    return views


@dataclass
class CacheLayout:
    """What ``allocate_cache_tensors`` built, for reports and tests."""

    mode: str  #: "contiguous" | "hybrid" | "gqa"
    total_bytes: int
    page_size_bytes: int | None = None
    pool: Tensor | None = None
    raw_views: list[Tensor] = field(default_factory=list)
    #: (group key, layer idx) -> {cache_name: tensor}
    views: dict[tuple[str, int], dict[str, Tensor]] = field(default_factory=dict)
    #: group key -> share of the bytes a block of that group occupies that hold no data
    #: (page padding, plus pages of raw views the group has no layer for)
    padding_by_group: dict[str, float] = field(default_factory=dict)

    @property
    def padding_fraction(self) -> float:
        """The worst group's padding share (0.0 for the contiguous layout)."""
        return max(self.padding_by_group.values(), default=0.0)

    def summary(self) -> dict:
        return {
            "mode": self.mode,
            "total_bytes": self.total_bytes,
            "page_size_bytes": self.page_size_bytes,
            "padding_fraction": round(self.padding_fraction, 6),
            "padding_by_group": {k: round(v, 6) for k, v in self.padding_by_group.items()},
        }


def _log_view(mode: str, key: str, layer_idx: int, name: str, t: Tensor, page: int | None):
    line = (
        f"{LOG_PREFIX} mode={mode} group={key} layer={layer_idx} cache={name} "
        f"shape={tuple(t.shape)} stride={tuple(t.stride())} "
        f"storage_offset={t.storage_offset()} contiguous={t.is_contiguous()}"
    )
    if page is not None:
        line += f" page_size_bytes={page}"
    logger.info(line)


def _is_mamba_group(group: KVCacheGroup) -> bool:
    return group.attn_type == AttnType.MAMBA.value


def allocate_cache_tensors(
    groups: Mapping[str, KVCacheGroup],
    num_blocks: Mapping[str, int],
    *,
    device: str | torch.device = "cpu",
    use_hybrid_blocks: bool = False,
    page_alignment_bytes: int = 128,
    log_layout: bool = False,
) -> CacheLayout:
    """Allocate every group's caches and bind them to their layers (see module docstring).

    Args:
        log_layout: log one ``[non-contiguous-kv-cache]`` line per view built, plus a
            summary line for a page pool.
    """
    if log_layout:
        _route_layout_log()
    if not use_hybrid_blocks:
        layout = CacheLayout(mode="contiguous", total_bytes=0)
        for key, g in groups.items():
            nb = num_blocks[key]
            for layer, entries in g.layers:
                dense = {
                    e.cache_name: huge_pages.zeros(
                        (nb, *e.block_shape(g.block_size)), dtype=e.dtype, device=device
                    )
                    for e in entries
                }
                layout.views[(key, layer.layer_idx)] = bind_kv_cache(
                    layer, dense, entries, g.block_size
                )
                for name, t in dense.items():
                    layout.total_bytes += t.numel() * t.element_size()
                    if log_layout:
                        _log_view("contiguous", key, layer.layer_idx, name, t, None)
        layout.padding_by_group = dict.fromkeys(groups, 0.0)
        return layout

    nb = max(num_blocks.values())
    page = page_size_bytes(groups, page_alignment_bytes)
    num_raw = max(len(g.layers) for g in groups.values())
    has_mamba = any(_is_mamba_group(g) for g in groups.values())
    mode = "hybrid" if has_mamba or len(groups) > 1 else "gqa"
    pool = huge_pages.zeros((num_raw * nb * page,), dtype=torch.int8, device=device)
    raws = [pool[j * nb * page : (j + 1) * nb * page].view(nb, page) for j in range(num_raw)]
    layout = CacheLayout(
        mode=mode, total_bytes=pool.numel(), page_size_bytes=page, pool=pool, raw_views=raws
    )
    for key, g in groups.items():
        payload = 0
        for j, (layer, entries) in enumerate(g.layers):
            views = bind_kv_cache(layer, raws[j], entries, g.block_size)
            layout.views[(key, layer.layer_idx)] = views
            payload += entry_offsets(entries, g.block_size)[1]
            if log_layout:
                for name, t in views.items():
                    mamba_page = page if _is_mamba_group(g) else None
                    _log_view(mode, key, layer.layer_idx, name, t, mamba_page)
        # A block id of this group takes page b in every raw view, used or not.
        layout.padding_by_group[key] = 1.0 - payload / (page * num_raw)
    if log_layout:
        logger.info(
            f"{LOG_PREFIX} mode={mode} pool_bytes={pool.numel()} page_size_bytes={page} "
            f"num_blocks={nb} raw_views={num_raw} padding_fraction={layout.padding_fraction:.4f}"
        )
    return layout


def calculate_block_num(
    groups: Mapping[str, KVCacheGroup],
    memory_budget_bytes: int,
    *,
    use_hybrid_blocks: bool = False,
    page_alignment_bytes: int = 128,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    fixed_block_attn_types: Collection[str] = (),
) -> dict[str, int]:
    """Blocks per group (null included) that fit the budget (``kvskill.core.kv_blocks``).

    Page pool: one shared pool, every block costs one page in each raw view. Contiguous:
    fixed-block types (when ``max_num_seqs`` bounds them) get ``max_num_seqs *
    max_blocks_per_request + 1`` blocks off the top; the growing groups share the rest with
    one common block count.
    """
    if memory_budget_bytes is None or memory_budget_bytes <= 0:
        raise BadInputError(f"memory budget must be positive, got {memory_budget_bytes}")
    if use_hybrid_blocks:
        page = page_size_bytes(groups, page_alignment_bytes)
        num_raw = max(len(g.layers) for g in groups.values())
        pool = GroupBlockCost(
            key="page_pool", bytes_per_block=page * num_raw, max_blocks_per_request=None
        )
        split = split_kv_budget([pool], budget_bytes=memory_budget_bytes, max_num_seqs=None)
        return dict.fromkeys(groups, split.num_blocks["page_pool"])
    costs = [
        group_block_cost(g, max_num_batched_tokens, fixed_block_attn_types) for g in groups.values()
    ]
    split = split_kv_budget(costs, budget_bytes=memory_budget_bytes, max_num_seqs=max_num_seqs)
    if not split.fits:
        raise BadInputError(
            f"memory budget {memory_budget_bytes} B is smaller than the fixed-block groups "
            f"need ({split.reserved_bytes} B); raise it or lower max_num_seqs"
        )
    return split.num_blocks


def group_block_cost(
    group: KVCacheGroup,
    max_num_batched_tokens: int | None,
    fixed_block_attn_types: Collection[str],
) -> GroupBlockCost:
    """A group's block price and per-request bound (its manager's hook), for the budget."""
    per_request = None
    if group.attn_type in fixed_block_attn_types:
        per_request = ATTN_TYPE_MANAGER_MAP[group.attn_type].max_blocks_per_request(
            block_size=group.block_size,
            sliding_window=group.sliding_window,
            max_num_batched_tokens=max_num_batched_tokens,
            next_n=group.next_n,
        )
    return GroupBlockCost(
        key=group.key,
        bytes_per_block=group.bytes_per_block(),
        max_blocks_per_request=per_request,
    )


def calculate_fixed_block_num(
    group: KVCacheGroup,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    fixed_block_attn_types: Collection[str],
) -> int | None:
    """Blocks a fixed-block group needs for ``max_num_seqs`` requests, or None if unbounded."""
    cost = group_block_cost(group, max_num_batched_tokens, fixed_block_attn_types)
    if cost.max_blocks_per_request is None or max_num_seqs is None:
        return None
    return reserved_pool_blocks(cost.max_blocks_per_request, max_num_seqs)


def choose_hybrid_block_size(
    attention_bytes_per_token: int, mamba_page_bytes: int, kernel_block_size: int = 16
) -> int:
    """Smallest multiple of the kernel block size whose attention page holds a Mamba page
    (``kvskill.core.cache_bytes.hybrid_block_size``, which the analyzer's Plan reports)."""
    return hybrid_block_size(attention_bytes_per_token, mamba_page_bytes, kernel_block_size)
