"""Block pool abstractions for paged-attention KV cache management."""

from __future__ import annotations

import random
from collections import deque

NULL_BLOCK_ID = 0


class BlockPool:
    """Owns the physical block ids of one pool and their free queue.

    Block 0 is the reserved null block: it is never handed out, block tables are padded with
    it, and sliding-window managers put it where a block slid out of the window. The free
    queue hands out the oldest freed block first; freed blocks go to its tail. Allocation and
    free are O(1) per block, and every free is checked (null, foreign or already-free ids are
    rejected), so a bookkeeping bug surfaces at the call that made it.
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
        self.free_block_queue: deque[int] = deque(ids)
        self._is_free = bytearray(num_blocks)  # 1 = in the free queue
        for block_id in ids:
            self._is_free[block_id] = 1
        self.num_allocations = 0
        self.num_frees = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks off the free queue.

        Raises:
            ValueError: when fewer blocks are free; callers check ``num_free_blocks`` first.
        """
        if num_blocks > len(self.free_block_queue):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {len(self.free_block_queue)} free"
            )
        popleft = self.free_block_queue.popleft
        blocks = [popleft() for _ in range(num_blocks)]
        for block_id in blocks:
            self._is_free[block_id] = 0
        self.num_allocations += num_blocks
        return blocks

    def free_blocks(self, block_ids: list[int]) -> None:
        """Return blocks to the tail of the free queue (null ids in the list are skipped).

        Raises:
            ValueError: on an id outside the pool or a block that is already free; nothing
                is freed in that case.
        """
        real = [b for b in block_ids if b != NULL_BLOCK_ID]
        for block_id in real:
            if not 0 < block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} does not belong to this pool")
            if self._is_free[block_id]:
                raise ValueError(f"double free of block {block_id}")
        if len(set(real)) != len(real):
            raise ValueError(f"block ids freed twice in one call: {sorted(real)}")
        for block_id in real:
            self._is_free[block_id] = 1
        self.free_block_queue.extend(real)
        self.num_frees += len(real)

    def is_free(self, block_id: int) -> bool:
        return bool(self._is_free[block_id])

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
        }
