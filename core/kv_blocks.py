"""The blocks a KV memory budget pays for: one arithmetic for analyze's plan and run's pools.

Contiguous layout: each cache group has its own pool, and block 0 of every pool is the null
block (never handed out; it keeps released table entries valid), so a pool of ``n`` blocks
holds ``n - 1`` usable ones. A group whose requests hold a bounded number of blocks (a
window, a per-request state row) is paid first: ``max_num_seqs`` requests' worth plus its
null block. Whatever is left is split among the groups that grow with the sequence, which
all get the same block count, since every token takes one slot in each of them.

Worked example (a 3-layer Jamba, bfloat16, block_size 128, 256 MiB, max_num_seqs 128)::

    FullAttention  1 layer x 128 B per token x 128 tokens = 16,384 B per block, grows
    Mamba          2 layers' conv + SSM rows = 3,584 B per request, 1 block per request
    Mamba pool     128 requests x 1 + 1 null = 129 blocks = 462,336 B (paid first)
    left           268,435,456 - 462,336 = 267,973,120 B
    FullAttention  267,973,120 // 16,384 = 16,355 blocks (16,354 usable + the null block)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: block 0 of every pool: what an unused or released block-table entry points at
NULL_BLOCKS_PER_POOL = 1
#: requests in flight at most when none is given (``kvskill run --max-num-seqs``)
DEFAULT_MAX_NUM_SEQS = 128
#: tokens computed in one step at most when none is given (``--max-num-batched-tokens``)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True, kw_only=True)
class GroupBlockCost:
    """What one block of a cache group costs, and how many one request can hold."""

    #: the group's key (its attn_type, or its manager key)
    key: str
    #: bytes one block id takes over every layer of the group
    bytes_per_block: int
    #: blocks one request holds at most (window, state row), None when it grows with length
    max_blocks_per_request: int | None


@dataclass(frozen=True, kw_only=True)
class KVBlockSplit:
    """Blocks per group for one budget, and what the budget paid for."""

    #: group key -> blocks of its pool, the null block included (``run --num-blocks``)
    num_blocks: dict[str, int]
    #: bytes paid first: bounded groups' blocks for ``max_num_seqs`` requests + their nulls
    reserved_bytes: int
    #: bytes left for the growing groups (negative: the budget does not cover the reserve)
    shared_bytes: int
    #: bytes one block costs summed over the growing groups (0 when none grows)
    growing_bytes_per_block: int
    #: keys of the groups paid first
    reserved_keys: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Whether the budget covers what the bounded groups reserve."""
        return self.shared_bytes >= 0

    @property
    def growing_keys(self) -> list[str]:
        return [key for key in self.num_blocks if key not in self.reserved_keys]


def reserved_pool_blocks(max_blocks_per_request: int, max_num_seqs: int) -> int:
    """Pool size of a bounded group: ``max_num_seqs`` requests' blocks plus the null block."""
    return max_num_seqs * max_blocks_per_request + NULL_BLOCKS_PER_POOL


def split_kv_budget(
    groups: Sequence[GroupBlockCost], *, budget_bytes: int, max_num_seqs: int | None
) -> KVBlockSplit:
    """Blocks per group (null block included) that ``budget_bytes`` pays for.

    A group with ``max_blocks_per_request`` gets :func:`reserved_pool_blocks` blocks, paid
    first; with ``max_num_seqs`` None nothing bounds it, and it grows like the others. The
    growing groups share the rest with one block count:
    ``(budget - reserved) // sum(bytes_per_block of the growing groups)``.

    Example: budget 1,000 B, a window group of 10 B blocks holding 3 per request, a full
    attention group of 40 B blocks, max_num_seqs 4: the window pool is 4 x 3 + 1 = 13
    blocks = 130 B; the full attention pool (1,000 - 130) // 40 = 21 blocks (20 usable).
    """
    num_blocks: dict[str, int] = {}
    reserved: list[str] = []
    reserved_bytes = 0
    for group in groups:
        if group.max_blocks_per_request is None or max_num_seqs is None:
            continue
        n = reserved_pool_blocks(group.max_blocks_per_request, max_num_seqs)
        num_blocks[group.key] = n
        reserved.append(group.key)
        reserved_bytes += n * group.bytes_per_block
    shared = budget_bytes - reserved_bytes
    growing = [g for g in groups if g.key not in num_blocks]
    per_block = sum(g.bytes_per_block for g in growing)
    for group in growing:
        num_blocks[group.key] = max(shared, 0) // per_block if per_block else 0
    return KVBlockSplit(
        num_blocks={g.key: num_blocks[g.key] for g in groups},
        reserved_bytes=reserved_bytes,
        shared_bytes=shared,
        growing_bytes_per_block=per_block,
        reserved_keys=tuple(reserved),
    )


def window_blocks_per_request(
    *, sliding_window: int | None, block_size: int, max_num_batched_tokens: int | None
) -> int | None:
    """Blocks a sliding-window request holds at most after one step of new tokens.

    ``W - 1`` older keys stay visible plus up to ``max_num_batched_tokens`` new ones, and the
    span may straddle one more block: ``ceil((W - 1 + T) / block_size) + 1``. Example: W 64,
    T 2048, block_size 128: ceil(2111 / 128) + 1 = 18. None when either bound is unknown.
    """
    if sliding_window is None or max_num_batched_tokens is None:
        return None
    return -(-(sliding_window - 1 + max_num_batched_tokens) // block_size) + 1
