"""Block pool abstractions for paged-attention KV cache management."""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from kvskill.runtime.prefix_hash import BlockHash

NULL_BLOCK_ID = 0


class BlockPool:
    """Owns the physical block ids of one pool, their reference counts and the free queue.

    Block 0 is the reserved null block: it is never handed out nor cached, block tables are
    padded with it, and sliding-window managers put it where a block slid out of the window.

    Every other block is either held (reference count >= 1: one per request holding it) or
    free (count 0, in the free queue). The free queue hands out its head first; a block
    whose count drops to 0 goes to its tail. So the free queue is also the LRU order of the
    prefix cache: a free block may still carry the hash of the full block it holds (it stays
    in ``cached_block_hash_to_block``), a request that matches the hash takes it back out of
    the queue (``touch``), and only when ``get_new_blocks`` hands it out for new content is
    its hash dropped (evicted), least recently freed first. Allocation, free and touch are
    O(1) per block (the queue is an ordered dict), and every free is checked (null, foreign
    or already-free ids are rejected), so a bookkeeping bug surfaces at the call that made it.
    """

    def __init__(self, num_blocks: int, *, free_block_order_seed: int | None = None) -> None:
        """
        Args:
            num_blocks: physical blocks including the null block (so ``num_blocks - 1`` usable).
            free_block_order_seed: when set, the initial free order is a seeded shuffle, so
                requests receive non-sequential block ids (used to verify that nothing
                depends on contiguous ids).
        """
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (null + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        ids = list(range(1, num_blocks))
        if free_block_order_seed is not None:
            random.Random(free_block_order_seed).shuffle(ids)
        #: block id -> None, head first (an ordered dict: O(1) removal from the middle)
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(ids)
        #: holders of each block (0 = free); the null block's count stays 0
        self.ref_cnt = array("i", bytes(4 * num_blocks))
        #: the hash of the full block each block holds, None when it is not cached
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        #: the prefix cache: hash -> the block holding that content
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}
        self.num_allocations = 0
        self.num_frees = 0
        #: cached blocks whose hash was dropped to reuse the block
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted on demand)."""
        return len(self.free_block_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a hash (held or free)."""
        return len(self.cached_block_hash_to_block)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks off the head of the free queue, evicting their hashes.

        Raises:
            ValueError: when fewer blocks are free; callers check ``num_free_blocks`` first.
        """
        if num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {len(self.free_block_queue)} free"
            )
        popitem = self.free_block_queue.popitem
        blocks = [popitem(last=False)[0] for _ in range(num_blocks)]
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        for block_id in blocks:
            ref_cnt[block_id] = 1
            if block_hash[block_id] is not None:
                self._evict(block_id)
        self.num_allocations += num_blocks
        return blocks

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        self.block_hash[block_id] = None
        if self.cached_block_hash_to_block.get(block_hash) == block_id:
            del self.cached_block_hash_to_block[block_hash]
        self.num_evictions += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; those left unheld go to the free queue's tail
        in the order given (null ids in the list are skipped).

        Raises:
            ValueError: on an id outside the pool or a block that is already free; nothing
                is freed in that case.
        """
        real = [b for b in block_ids if b != NULL_BLOCK_ID]
        ref_cnt = self.ref_cnt
        for block_id in real:
            if not 0 < block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} does not belong to this pool")
            if ref_cnt[block_id] == 0:
                raise ValueError(f"double free of block {block_id}")
        if len(set(real)) != len(real):
            raise ValueError(f"block ids freed twice in one call: {sorted(real)}")
        queue = self.free_block_queue
        for block_id in real:
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                queue[block_id] = None
        self.num_frees += len(real)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each (cached) block, taking unheld ones out of the free queue."""
        ref_cnt, queue = self.ref_cnt, self.free_block_queue
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            if ref_cnt[block_id] == 0:
                del queue[block_id]
            ref_cnt[block_id] += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that the held ``block_id`` now holds the full block named ``block_hash``.

        Returns:
            False when the hash is already cached in another block (two requests computed
            the same content; the first one stays the cached copy) or this block already
            carries a hash; True when the block was added to the cache.
        """
        if block_id == NULL_BLOCK_ID:
            raise ValueError("the null block is never cached")
        if self.ref_cnt[block_id] == 0:
            raise ValueError(f"block {block_id} is free: only held blocks are cached")
        if self.block_hash[block_id] is not None or block_hash in self.cached_block_hash_to_block:
            return False
        self.block_hash[block_id] = block_hash
        self.cached_block_hash_to_block[block_hash] = block_id
        return True

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of a free block (held ones keep theirs); returns how many."""
        dropped = 0
        for block_id in self.free_block_queue:
            if self.block_hash[block_id] is not None:
                del self.cached_block_hash_to_block[self.block_hash[block_id]]
                self.block_hash[block_id] = None
                dropped += 1
        return dropped

    def is_free(self, block_id: int) -> bool:
        return block_id != NULL_BLOCK_ID and self.ref_cnt[block_id] == 0

    def usage(self) -> dict[str, int | float]:
        """A report: totals, free and used blocks, and the used fraction of usable blocks."""
        used = self.num_usable_blocks - self.num_free_blocks
        return {
            "num_blocks": self.num_blocks,
            "num_usable_blocks": self.num_usable_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": used,
            "usage": used / self.num_usable_blocks,
            "num_allocations": self.num_allocations,
            "num_frees": self.num_frees,
            "num_cached_blocks": self.num_cached_blocks,
            "num_evictions": self.num_evictions,
        }
