"""Coordinates the per-group managers: sizing, all-or-nothing allocation, freeing, reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvskill.core.attn_types import AttnType
from kvskill.core.errors import BadInputError
from kvskill.runtime.block_pool import BlockPool
from kvskill.runtime.cache_info import ModelCacheInfo, validate_cache_info
from kvskill.runtime.kv_cache_groups import KVCacheGroup, build_groups
from kvskill.runtime.layout import CacheLayout, allocate_cache_tensors, calculate_block_num
from kvskill.runtime.managers import (
    ATTN_TYPE_MANAGER_MAP,
    FIXED_BLOCK_ATTN_TYPES,
    SingleTypeKVCacheManager,
)
from kvskill.runtime.prefix_hash import HashableRequest, block_hashes
from kvskill.runtime.tables import StepTables
from torch import Tensor


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """What one successful ``allocate_slots`` call gave a request: its new blocks per group.

    The scheduler only learns that the allocation happened and what it added; where the
    managers keep each request's table stays theirs (vLLM's ``KVCacheBlocks`` exists for the
    same reason). ``allocate_slots`` returns None instead when it cannot allocate now.

    NOTE: no ``__len__``/``__bool__`` on purpose: an allocation that needed no new block is
    still a success, and must not read as false the way None does.
    """

    #: group key -> ids of the blocks appended by this call, in logical order; empty for a
    #: group whose blocks already covered the tokens (every group key is present)
    new_block_ids: Mapping[str, tuple[int, ...]]

    @property
    def num_new_blocks(self) -> int:
        """Blocks taken by this call over all groups (a shared pool counts each group's)."""
        return sum(map(len, self.new_block_ids.values()))


class KVCacheManager:
    """Owns one SingleTypeKVCacheManager per group and the block pools behind them.

    Contiguous layout: one pool per group. Page-pool layout (``use_hybrid_blocks``): one pool
    shared by all groups, so a block id names the same physical page in every group.
    """

    def __init__(
        self,
        cache_info: ModelCacheInfo,
        *,
        num_blocks: int | None = None,
        memory_budget_bytes: int | None = None,
        device: str = "cpu",
        use_hybrid_blocks: bool = False,
        free_block_order_seed: int | None = None,
        page_alignment_bytes: int = 128,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = False,
        next_n: int = 0,
    ) -> None:
        """
        Args:
            next_n: drafts per speculative verify step: window groups keep a margin of
                ``2 * next_n`` tokens (state groups take theirs from their Mamba entries'
                ``next_n``).
            enable_prefix_caching: share the K/V of full blocks between requests with the
                same prefix (see ``get_computed_blocks``); refused for a model with a group
                that cannot share blocks, the reason in ``prefix_caching_disabled_reason``.

        Raises:
            CacheInfoError: an entry's attn_type has no registered manager, or the
                declarations changed into something invalid since they were built.
            BadInputError: no entry needs blocks, or the sizing gives a group < 2 blocks.
        """
        validate_cache_info(cache_info, known_attn_types=ATTN_TYPE_MANAGER_MAP)
        self.cache_info = cache_info
        self.device = device
        self.use_hybrid_blocks = use_hybrid_blocks
        self.page_alignment_bytes = page_alignment_bytes
        self.groups: dict[str, KVCacheGroup] = build_groups(cache_info)
        for group in self.groups.values():
            if group.attn_type == AttnType.SLIDING_WINDOW.value:
                group.next_n = next_n
        if not self.groups:
            raise BadInputError("the model declares no cache entry that needs blocks")
        if num_blocks is None and memory_budget_bytes is None:
            raise BadInputError("give num_blocks or memory_budget_bytes to size the KV cache")
        if num_blocks is not None:
            self.num_blocks = dict.fromkeys(self.groups, num_blocks)
        else:
            self.num_blocks = self.calculate_block_num(
                memory_budget_bytes,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
            )
        for key, n in self.num_blocks.items():
            if n < 2:
                row = (
                    f" (a {AttnType.LEGACY.value} block is one request's whole row of "
                    f"{self.groups[key].block_size} tokens: a smaller max_model_len shrinks it)"
                    if self.groups[key].attn_type == AttnType.LEGACY.value
                    else ""
                )
                raise BadInputError(
                    f"group {key!r} gets {n} blocks; at least 2 (null + 1) are needed. "
                    f"Raise the memory budget or num_blocks{row}"
                )
        self.pools = self._build_pools(free_block_order_seed)
        self.managers: dict[str, SingleTypeKVCacheManager] = {
            key: ATTN_TYPE_MANAGER_MAP[g.attn_type](
                self.pools[key],
                group_key=key,
                block_size=g.block_size,
                sliding_window=g.sliding_window,
                compress_ratio=g.compress_ratio,
                next_n=g.next_n,
            )
            for key, g in self.groups.items()
        }
        #: why prefix caching is off although it was asked for (None: on, or not asked)
        self.prefix_caching_disabled_reason: str | None = None
        if enable_prefix_caching:
            self.prefix_caching_disabled_reason = self._prefix_caching_refusal()
        self.enable_prefix_caching = (
            enable_prefix_caching and self.prefix_caching_disabled_reason is None
        )
        for mgr in self.managers.values():
            mgr.enable_caching = self.enable_prefix_caching
        self.initial_free_blocks = self.num_free_blocks
        self.layout: CacheLayout | None = None  # set by allocate_cache_tensors

    def _prefix_caching_refusal(self) -> str | None:
        # NOTE: a hit must hold in every group (each layer reads its own cache), so one group
        # that cannot share blocks turns prefix caching off for the whole model.
        for key, mgr in self.managers.items():
            if mgr.prefix_caching_unsupported:
                return (
                    f"group {key!r} ({self.groups[key].attn_type}) cannot reuse a prefix: "
                    f"{mgr.prefix_caching_unsupported}"
                )
        return None

    def ride_along_refusal(self) -> str | None:
        """Why decoding requests must not ride along in a step that computes prompt tokens
        (the first group whose type refuses it), or None when they may."""
        for key, mgr in self.managers.items():
            if mgr.ride_along_unsupported:
                return f"group {key!r} ({self.groups[key].attn_type}): {mgr.ride_along_unsupported}"
        return None

    def _build_pools(self, seed: int | None) -> dict[str, BlockPool]:
        if self.use_hybrid_blocks:
            shared = BlockPool(max(self.num_blocks.values()), free_block_order_seed=seed)
            return dict.fromkeys(self.groups, shared)
        return {key: BlockPool(n, free_block_order_seed=seed) for key, n in self.num_blocks.items()}

    # ---- sizing ------------------------------------------------------------------------
    def calculate_block_num(
        self,
        memory_budget_bytes: int,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> dict[str, int]:
        """Blocks per group (null block included) that fit in ``memory_budget_bytes``."""
        return calculate_block_num(
            self.groups,
            memory_budget_bytes,
            use_hybrid_blocks=self.use_hybrid_blocks,
            page_alignment_bytes=self.page_alignment_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            fixed_block_attn_types=FIXED_BLOCK_ATTN_TYPES,
        )

    def allocate_cache_tensors(self, *, log_layout: bool = False) -> None:
        """Create every cache tensor and hand it to its layer (``tensor_setter``/bind).

        Args:
            log_layout: log every view built (``[non-contiguous-kv-cache]`` lines).
        """
        self.layout = allocate_cache_tensors(
            self.groups,
            self.num_blocks,
            device=self.device,
            use_hybrid_blocks=self.use_hybrid_blocks,
            page_alignment_bytes=self.page_alignment_bytes,
            log_layout=log_layout,
        )

    # ---- per-request -------------------------------------------------------------------
    @property
    def group_keys(self) -> list[str]:
        return list(self.groups)

    @property
    def token_group_keys(self) -> list[str]:
        """Groups whose blocks hold tokens."""
        return [k for k, m in self.managers.items() if m.is_token_addressed]

    @property
    def slotless_group_keys(self) -> list[str]:
        """Token groups without a slot mapping: compressed ones, whose rows the model
        addresses from the block table (see ``managers.SingleTypeKVCacheManager``)."""
        return [
            k for k, m in self.managers.items() if m.is_token_addressed and not m.has_slot_mapping
        ]

    @property
    def state_group_keys(self) -> list[str]:
        """Groups with one state block per request (Mamba): block_table[:, 0] is the index."""
        return [k for k, m in self.managers.items() if not m.is_token_addressed]

    def block_size_of(self, group_key: str) -> int:
        return self.groups[group_key].block_size

    def _blocks_needed_per_pool(
        self,
        request_id: str,
        num_tokens: int,
        num_computed_tokens: int | None,
        computed_blocks: Mapping[str, Sequence[int]] | None = None,
    ) -> dict[int, tuple[BlockPool, int]]:
        needed: dict[int, tuple[BlockPool, int]] = {}
        for key, mgr in self.managers.items():
            computed = (
                mgr.num_tokens(request_id) if num_computed_tokens is None else num_computed_tokens
            )
            pool = self.pools[key]
            hit = computed_blocks.get(key, ()) if computed_blocks else ()
            net = mgr.get_num_blocks_to_allocate(request_id, num_tokens, computed, hit)
            needed[id(pool)] = (pool, needed.get(id(pool), (pool, 0))[1] + net)
        return needed

    def can_allocate(
        self,
        request_id: str,
        num_tokens: int,
        num_computed_tokens: int | None = None,
        computed_blocks: Mapping[str, Sequence[int]] | None = None,
    ) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed now."""
        needed = self._blocks_needed_per_pool(
            request_id, num_tokens, num_computed_tokens, computed_blocks
        )
        return all(net <= pool.num_free_blocks for pool, net in needed.values())

    # ---- prefix caching ----------------------------------------------------------------
    def get_computed_blocks(self, request: HashableRequest) -> tuple[int, dict[str, list[int]]]:
        """The longest prefix of the request's tokens cached in every group, and its blocks.

        The hit is whole blocks of every group and never the whole request: at least one
        token is computed, so the step has a last position to sample from (a request whose
        tokens are all cached recomputes the last one, in a block of its own). Groups are
        asked in turn with the shortest length so far until all agree (a window group may
        accept only a shorter hit; full attention accepts any prefix of its own).

        Returns:
            (tokens hit, group key -> block ids of logical blocks 0.. of the hit); (0, {})
            with prefix caching off or on a miss. Nothing is touched: pass the blocks to
            ``allocate_slots`` to take them.
        """
        if not self.enable_prefix_caching or any(
            request.request_id in mgr.req_to_blocks for mgr in self.managers.values()
        ):
            return 0, {}
        length = request.num_tokens - 1
        hits: dict[str, list[int]] = {}
        while length > 0:
            agreed = True
            for key, mgr in self.managers.items():
                bs = mgr.block_size
                hashes = block_hashes(request, key, bs, length // bs)
                blocks = mgr.find_longest_cache_hit(hashes, length)
                hits[key] = blocks
                if len(blocks) * bs < length:
                    length = len(blocks) * bs
                    agreed = False
            if agreed:
                break
        if length <= 0:
            return 0, {}
        return length, {
            key: blocks[: length // self.managers[key].block_size] for key, blocks in hits.items()
        }

    def cache_blocks(self, request: HashableRequest, num_computed_tokens: int) -> None:
        """Offer every full block the request's computed tokens fill to the prefix cache."""
        if self.enable_prefix_caching:
            for mgr in self.managers.values():
                mgr.cache_blocks(request, num_computed_tokens)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a prefix-cache hash, over every pool (held or free)."""
        return sum(p.num_cached_blocks for p in {id(p): p for p in self.pools.values()}.values())

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of every free block; returns how many were dropped."""
        return sum(p.reset_prefix_cache() for p in {id(p): p for p in self.pools.values()}.values())

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        num_computed_tokens: int | None = None,
        computed_blocks: Mapping[str, Sequence[int]] | None = None,
    ) -> KVCacheBlocks | None:
        """Make every group cover ``num_tokens`` tokens of the request, or change nothing.

        Stages: check every pool (``can_allocate``), then release the blocks each group no
        longer needs, then append new blocks in every group. Checking first across all
        groups means a request is never left half-allocated.

        Args:
            request_id: any hashable string id.
            num_tokens: TOTAL tokens that need a slot, already computed ones included.
            num_computed_tokens: tokens whose KV is already in the cache; defaults to the
                total of the previous allocation (the engine computes what it allocated).
                Windowed groups release the blocks no query from there on can see.
            computed_blocks: a prefix-cache hit from ``get_computed_blocks`` for a request
                that holds no block yet (its ``num_computed_tokens`` is the hit length):
                the request starts by sharing these blocks.

        Returns:
            the blocks added per group on success; None (nothing changed) when some pool
            is short of blocks now.

        Raises:
            ValueError: when ``num_computed_tokens`` exceeds ``num_tokens``.
        """
        if num_computed_tokens is not None and num_computed_tokens > num_tokens:
            raise ValueError(
                f"request {request_id!r}: num_computed_tokens={num_computed_tokens} exceeds "
                f"num_tokens={num_tokens} (num_tokens counts computed + new tokens)"
            )
        if not self.can_allocate(request_id, num_tokens, num_computed_tokens, computed_blocks):
            return None
        if computed_blocks:
            # NOTE: before any new block is taken, so the hit cannot be evicted under it.
            for key, mgr in self.managers.items():
                mgr.add_computed_blocks(request_id, computed_blocks[key])
        for mgr in self.managers.values():
            computed = (
                mgr.num_tokens(request_id) if num_computed_tokens is None else num_computed_tokens
            )
            mgr.remove_skipped_blocks(request_id, computed)
        return KVCacheBlocks(
            {
                key: tuple(mgr.allocate_new_blocks(request_id, num_tokens))
                for key, mgr in self.managers.items()
            }
        )

    def allocate_slots_batch(
        self,
        request_ids: Sequence[str],
        num_tokens: Sequence[int],
        num_computed_tokens: Sequence[int],
    ) -> int:
        """``allocate_slots`` for each request in turn, stopping at the first that fails.

        The pools end up exactly as after calling ``allocate_slots(request_ids[i],
        num_tokens[i], num_computed_tokens[i])`` for i = 0, 1, ... until the first None
        (same blocks, same order), but only the requests that take or release blocks in
        some group do the full per-request work; the rest just record their token count.

        Returns:
            how many leading requests were served (``len(request_ids)`` when all were).

        Raises:
            ValueError: when some ``num_computed_tokens[i]`` exceeds ``num_tokens[i]``.
        """
        for rid, total, computed in zip(request_ids, num_tokens, num_computed_tokens, strict=True):
            if computed > total:
                raise ValueError(
                    f"request {rid!r}: num_computed_tokens={computed} exceeds "
                    f"num_tokens={total} (num_tokens counts computed + new tokens)"
                )
        managers = list(self.managers.values())
        changed = sorted(
            {
                i
                for mgr in managers
                for i in mgr.requests_to_update(request_ids, num_tokens, num_computed_tokens)
            }
        )
        served = len(request_ids)
        for i in changed:
            if self.allocate_slots(request_ids[i], num_tokens[i], num_computed_tokens[i]) is None:
                served = i
                break
        if served < len(request_ids):
            request_ids, num_tokens = request_ids[:served], num_tokens[:served]
        for mgr in managers:
            mgr.record_num_tokens(request_ids, num_tokens)
        return served

    def free(self, request_id: str) -> None:
        for mgr in self.managers.values():
            mgr.free(request_id)

    def get_block_ids(self, request_id: str) -> dict[str, list[int]]:
        """Per group, the request's block ids in logical order (0 = released / null)."""
        return {key: mgr.get_block_ids(request_id) for key, mgr in self.managers.items()}

    def step_tables(
        self,
        request_ids: Sequence[str],
        *,
        starts: Sequence[int],
        num_new_tokens: Sequence[int],
    ) -> StepTables:
        """Block tables of every group and slot mappings of every token group for one step.

        Each group's manager builds its own from the blocks it holds, so the step builder
        never sees how they are stored (host tensors; the caller moves them to the device).

        Args:
            request_ids: the step's requests, in batch order; each already allocated.
            starts: position of each request's first new token (= its cached tokens).
            num_new_tokens: tokens each request feeds this step (>= 1).
        """
        block_table: dict[str, Tensor] = {}
        slot_mapping: dict[str, Tensor] = {}
        for key, mgr in self.managers.items():
            tables = mgr.step_tables(request_ids, starts=starts, num_new_tokens=num_new_tokens)
            block_table[key] = tables.block_table
            if tables.slot_mapping is not None:
                slot_mapping[key] = tables.slot_mapping
        return StepTables(block_table=block_table, slot_mapping=slot_mapping)

    def tracked_request_ids(self) -> dict[str, list[str]]:
        """Per group, the requests its manager still holds blocks for (empty when idle)."""
        return {key: mgr.request_ids for key, mgr in self.managers.items()}

    def max_tokens_per_request(
        self, *, max_num_batched_tokens: int, enable_chunked_prefill: bool
    ) -> int:
        """The longest request (prompt + output) the empty pools can hold.

        Growing groups need ``ceil(n / block_size)`` blocks; windowed and state groups are
        bounded by what one step can add (a whole prompt when prefill is not chunked).
        """

        def fits(num_tokens: int) -> bool:
            step = min(num_tokens, max_num_batched_tokens) if enable_chunked_prefill else num_tokens
            need: dict[int, int] = {}
            for key, mgr in self.managers.items():
                group = self.groups[key]
                blocks = mgr.num_blocks_for(num_tokens)
                bound = mgr.max_blocks_per_request(
                    block_size=group.block_size,
                    sliding_window=group.sliding_window,
                    max_num_batched_tokens=step,
                    next_n=group.next_n,
                )
                if bound is not None:
                    blocks = min(blocks, bound)
                pool = self.pools[key]
                need[id(pool)] = need.get(id(pool), 0) + blocks
            return all(
                need[id(pool)] <= pool.num_usable_blocks
                for pool in {id(p): p for p in self.pools.values()}.values()
            )

        low, high = 0, 1
        while fits(high) and high < 1 << 24:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    @property
    def num_free_blocks(self) -> dict[str, int]:
        return {key: pool.num_free_blocks for key, pool in self.pools.items()}

    def usage(self) -> dict:
        """A JSON-ready report of groups, pools and the layout."""
        groups = {}
        for key, g in self.groups.items():
            groups[key] = {
                "attn_type": g.attn_type,
                "block_size": g.block_size,
                "sliding_window": g.sliding_window,
                "num_layers": len(g.layers),
                "num_entries": len(g.entries),
                "bytes_per_block": g.bytes_per_block(),
                "num_requests": len(self.managers[key].request_ids),
                "pool": self.pools[key].usage(),
            }
        report = {
            "layout": "page_pool" if self.use_hybrid_blocks else "contiguous",
            "groups": groups,
            "prefix_caching": self.enable_prefix_caching,
            "prefix_caching_disabled_reason": self.prefix_caching_disabled_reason,
            "num_cached_blocks": self.num_cached_blocks,
        }
        if self.layout is not None:
            report["memory"] = self.layout.summary()
        return report

    def format_report(self) -> str:
        """The usage report as aligned text lines (one per group, then the memory line)."""
        report = self.usage()
        lines = [f"KV cache layout: {report['layout']}"]
        for key, g in report["groups"].items():
            pool = g["pool"]
            window = f" window={g['sliding_window']}" if g["sliding_window"] else ""
            lines.append(
                f"  {key:<16} {g['attn_type']:<14} block_size={g['block_size']:<4}{window} "
                f"layers={g['num_layers']} blocks used {pool['num_used_blocks']}/"
                f"{pool['num_usable_blocks']} ({pool['usage']:.1%}) requests={g['num_requests']}"
            )
        if "memory" in report:
            mem = report["memory"]
            page = f" page={mem['page_size_bytes']} B" if mem["page_size_bytes"] else ""
            lines.append(
                f"  memory: {mem['total_bytes']} B mode={mem['mode']}{page} "
                f"padding={mem['padding_fraction']:.1%}"
            )
        return "\n".join(lines)
