"""Per-attention-type block bookkeeping: which blocks each request holds, in logical order.

Registering a new attn_type
---------------------------
1. Subclass ``SingleTypeKVCacheManager`` and override only the hooks that differ:
   ``get_num_skipped_tokens`` (tokens no future query can see), ``num_blocks_for``
   (blocks a request of n tokens spans) and, for a type whose per-request block count is
   bounded, ``max_blocks_per_request``.
2. Call ``register_attn_type("MyType", MyManager, fixed_block=True|False)``. It adds the
   class to ``ATTN_TYPE_MANAGER_MAP`` and, for fixed-block types, the name to
   ``FIXED_BLOCK_ATTN_TYPES`` so ``KVCacheManager.calculate_block_num`` budgets the type with
   a fixed number of blocks per request instead of sharing the growing pool.
3. Declare caches with ``CacheEntry(attn_type="MyType", ...)``; validation accepts it from
   then on, and the group gets its own block table and slot mapping under that key.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import ClassVar

import torch
from kvskill.core.attn_types import AttnType
from kvskill.core.kv_blocks import window_blocks_per_request
from kvskill.runtime.block_pool import NULL_BLOCK_ID, BlockPool
from kvskill.runtime.prefix_hash import BlockHash, HashableRequest, block_hashes
from kvskill.runtime.tables import (
    GroupStepTables,
    int64_tensor,
    prepare_block_tables,
    prepare_slot_mapping,
    prepare_token_positions,
    slot_mapping_from_block_ids,
)
from torch import Tensor

#: what a request without blocks reads as (shared, never mutated)
_NO_BLOCKS = array("i")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Owns ``req_to_blocks`` for one group: each request's block ids in logical order.

    Logical block i of a request covers token positions ``[i * block_size, (i+1) * block_size)``,
    so ``slot = blocks[pos // block_size] * block_size + pos % block_size`` holds for every
    live token. Blocks nobody can read any more are released and replaced by the null block,
    which keeps those indices valid. Subclasses override narrow hooks only.

    A compressed group (``compress_ratio`` r > 1) keeps the same logical blocks: block i still
    covers tokens ``[i * block_size, (i+1) * block_size)`` (so prefix hashes, hits and
    preemption work on the tokens as for any group), and stores their
    ``storage_block_size = block_size // r`` rows; row c (tokens ``[c * r, (c+1) * r)``) sits
    at ``blocks[c // storage_block_size] * storage_block_size + c % storage_block_size``.
    As in the Ascend framework (cann-recipes-infer ``fbc225d``), such a group gets a block
    table and no slot mapping; the model forms its row slots itself:

    - ``executor/core/kv_cache/cache_utils.py:547-549``: ``prepare_slot_mapping`` skips a
      manager whose ``compress_ratio > 1`` (no ``slot_mapping[key]`` for it);
    - ``cache_utils.py:157`` and ``:288``: tensors are ``[blocks, storage_block_size, heads,
      dim]`` and a block costs ``block_size * row_bytes // compress_ratio``;
    - ``single_type_kv_cache_manager.py:175-181``: one FullAttention group, one ratio;
    - ``models/deepseek_v4/models/modules/attention_data.py:381-424``: the model's compressed
      slot mapping, ``block_table[b, c // bs] * bs + c % bs`` over compressed positions c,
      with ``bs`` the rows per block (its compressed entries declare ``block_size =
      rows * ratio``, ``modeling_deepseek.py:913-934``).

    ``tables.prepare_slot_mapping(block_table, request_index, rows, storage_block_size)`` gives
    the same slots.
    """

    attn_type: ClassVar[str] = ""
    #: True when blocks hold tokens (slot mapping applies); False for per-request state
    #: blocks, whose block table row is the request's state index instead
    is_token_addressed: ClassVar[bool] = True
    #: why a request of this type cannot reuse another's blocks, None when it can (a state
    #: block holds a snapshot of the whole prefix, not the K/V of one block's tokens)
    prefix_caching_unsupported: ClassVar[str | None] = None
    #: why a decoding request of this type must not ride along in a step that computes
    #: prompt tokens, None when it may (the layer's prefill path then sees its token as a
    #: one-token sequence)
    ride_along_unsupported: ClassVar[str | None] = None

    def __init__(
        self,
        block_pool: BlockPool,
        *,
        group_key: str,
        block_size: int,
        sliding_window: int | None = None,
        compress_ratio: int = 1,
        next_n: int = 0,
    ) -> None:
        self.block_pool = block_pool
        self.group_key = group_key
        self.block_size = block_size
        self.sliding_window = sliding_window
        #: tokens per stored row; > 1: the model addresses rows itself (no slot mapping)
        self.compress_ratio = compress_ratio
        #: drafts a speculative verify step feeds per request at most (0: no speculation)
        self.next_n = next_n
        #: block ids as C ints (``array("i")``): a step's block table is then a few memcpys
        #: per request instead of a conversion of every id
        self.req_to_blocks: dict[str, array] = {}
        #: tokens covered by the request's blocks after its last allocation
        self.req_to_num_tokens: dict[str, int] = {}
        #: logical blocks before this index are already null (released)
        self._req_to_num_released: dict[str, int] = {}
        #: whether this type ever skips tokens (releases blocks before the end)
        self._may_skip_tokens = (
            type(self).get_num_skipped_tokens is not SingleTypeKVCacheManager.get_num_skipped_tokens
        )
        #: whether ``num_blocks_for`` is the plain ceil(n / block_size)
        self._standard_blocks = type(self).num_blocks_for is SingleTypeKVCacheManager.num_blocks_for
        #: prefix caching on (set by the KV manager): full blocks get hashes, hits are shared
        self.enable_caching = False
        #: leading logical blocks of each request already offered to the prefix cache
        self._req_to_num_cached: dict[str, int] = {}

    # ---- hooks -------------------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no query from position ``num_computed_tokens`` on can attend to."""
        return 0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Logical blocks a request of ``num_tokens`` tokens spans."""
        return cdiv(num_tokens, self.block_size)

    @classmethod
    def max_blocks_per_request(
        cls,
        *,
        block_size: int,
        sliding_window: int | None,
        max_num_batched_tokens: int | None,
        next_n: int = 0,
    ) -> int | None:
        """Upper bound on one request's live blocks, or None when it grows with the sequence."""
        return None

    # ---- bookkeeping -------------------------------------------------------------------
    def _num_releasable(self, request_id: str, num_computed_tokens: int) -> tuple[int, int]:
        """(first logical block still needed, live blocks before it)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0, 0
        first_needed = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        first_needed = min(first_needed, len(blocks))
        start = self._req_to_num_released.get(request_id, 0)
        live = sum(1 for b in blocks[start:first_needed] if b != NULL_BLOCK_ID)
        return first_needed, live

    def requests_to_update(
        self,
        request_ids: Sequence[str],
        num_tokens: Sequence[int],
        num_computed_tokens: Sequence[int],
    ) -> list[int]:
        """Indices of the requests whose allocation would take or release blocks here.

        The others only record their new token count: a decode step crosses a block
        boundary for about one request in ``block_size``, so this is what lets the KV
        manager skip the full per-request allocation for most of a batch.
        """
        blocks = self.req_to_blocks
        bs = self.block_size
        if self._standard_blocks:
            # num_blocks_for(n) > held  <=>  held * block_size < n  (no hook call per request)
            changed = [
                i
                for i, (rid, n) in enumerate(zip(request_ids, num_tokens, strict=True))
                if rid not in blocks or len(blocks[rid]) * bs < n
            ]
        else:
            need = self.num_blocks_for
            changed = [
                i
                for i, (rid, n) in enumerate(zip(request_ids, num_tokens, strict=True))
                if rid not in blocks or need(n) > len(blocks[rid])
            ]
        if self._may_skip_tokens:
            released = self._req_to_num_released
            skipped = self.get_num_skipped_tokens
            sliding = [
                i
                for i, (rid, c) in enumerate(zip(request_ids, num_computed_tokens, strict=True))
                if rid in blocks and min(skipped(c) // bs, len(blocks[rid])) > released.get(rid, 0)
            ]
            if sliding:
                changed = sorted(set(changed).union(sliding))
        return changed

    def record_num_tokens(self, request_ids: Sequence[str], num_tokens: Sequence[int]) -> None:
        """Note the token counts of requests whose blocks already cover them."""
        counts = self.req_to_num_tokens
        for rid, n in zip(request_ids, num_tokens, strict=True):
            if n > counts.get(rid, 0):
                counts[rid] = n

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        num_computed_tokens: int,
        computed_blocks: Sequence[int] = (),
    ) -> int:
        """Net blocks this allocation takes from the pool (new blocks minus released ones).

        ``computed_blocks`` (a prefix-cache hit of a request that holds nothing yet) cost
        nothing new, except those nobody holds: taking them out of the free queue uses it up
        as much as a new block does.
        """
        held = len(self.req_to_blocks.get(request_id, ())) + len(computed_blocks)
        new = max(0, self.num_blocks_for(num_tokens) - held)
        first_needed, releasable = self._num_releasable(request_id, num_computed_tokens)
        pool = self.block_pool
        if releasable and self.enable_caching:
            # A block another request shares stays held when this one lets go of it.
            start = self._req_to_num_released.get(request_id, 0)
            ref_cnt = pool.ref_cnt
            releasable = sum(
                1
                for b in self.req_to_blocks[request_id][start:first_needed]
                if b != NULL_BLOCK_ID and ref_cnt[b] == 1
            )
        revived = sum(1 for b in computed_blocks if pool.is_free(b))
        return new - releasable + revived

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks wholly before the first token a future query can see."""
        first_needed, live = self._num_releasable(request_id, num_computed_tokens)
        if live == 0:
            if first_needed:
                self._req_to_num_released[request_id] = max(
                    first_needed, self._req_to_num_released.get(request_id, 0)
                )
            return
        blocks = self.req_to_blocks[request_id]
        start = self._req_to_num_released.get(request_id, 0)
        released = [b for b in blocks[start:first_needed] if b != NULL_BLOCK_ID]
        blocks[start:first_needed] = array("i", [NULL_BLOCK_ID]) * (first_needed - start)
        self._req_to_num_released[request_id] = first_needed
        self.block_pool.free_blocks(released)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Append blocks so the request covers ``num_tokens`` tokens; returns the new ids."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = array("i")
        new = self.block_pool.get_new_blocks(max(0, self.num_blocks_for(num_tokens) - len(blocks)))
        blocks.extend(new)
        self.req_to_num_tokens[request_id] = max(
            num_tokens, self.req_to_num_tokens.get(request_id, 0)
        )
        return new

    def free(self, request_id: str) -> None:
        """Release every block the request holds (unknown ids are a no-op).

        With prefix caching the blocks are freed last block first: the free queue is the
        eviction order, and a prefix's tail is the part least likely to be shared.
        """
        blocks = self.req_to_blocks.pop(request_id, None)
        self.req_to_num_tokens.pop(request_id, None)
        self._req_to_num_released.pop(request_id, None)
        self._req_to_num_cached.pop(request_id, None)
        if blocks:
            ids = blocks.tolist()
            if self.enable_caching:
                ids.reverse()
            self.block_pool.free_blocks(ids)

    # ---- prefix caching ----------------------------------------------------------------
    def find_longest_cache_hit(self, hashes: Sequence[BlockHash], max_length: int) -> list[int]:
        """The blocks of the longest cached prefix of at most ``max_length`` tokens.

        Returns the block ids of logical blocks 0..k-1 (the hit is ``k * block_size``
        tokens); a type that does not need every block of the prefix (a window) may put the
        null block where a block is not needed. Full attention: the leading run of hashes
        that are cached.
        """
        pool = self.block_pool
        hit: list[int] = []
        for block_hash in hashes[: max_length // self.block_size]:
            block_id = pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def add_computed_blocks(self, request_id: str, blocks: Sequence[int]) -> None:
        """Start a request that holds nothing with a prefix-cache hit (shared, touched)."""
        assert request_id not in self.req_to_blocks, "a hit only starts a request"
        self.block_pool.touch(blocks)
        self.req_to_blocks[request_id] = array("i", blocks)
        leading_null = next((i for i, b in enumerate(blocks) if b != NULL_BLOCK_ID), len(blocks))
        if leading_null:
            self._req_to_num_released[request_id] = leading_null
        self._req_to_num_cached[request_id] = len(blocks)
        self.req_to_num_tokens[request_id] = len(blocks) * self.block_size

    def cache_blocks(self, request: HashableRequest, num_computed_tokens: int) -> None:
        """Offer the request's blocks that ``num_computed_tokens`` filled to the cache."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        done = self._req_to_num_cached.get(request_id, 0)
        if num_full <= done:
            return
        hashes = block_hashes(request, self.group_key, self.block_size, num_full)
        pool = self.block_pool
        for i in range(done, num_full):
            if blocks[i] != NULL_BLOCK_ID:
                pool.cache_block(blocks[i], hashes[i])
        self._req_to_num_cached[request_id] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        blocks = self.req_to_blocks.get(request_id)
        return [] if blocks is None else blocks.tolist()

    @property
    def request_ids(self) -> list[str]:
        """The requests this manager holds blocks for, in the order they first got some."""
        return list(self.req_to_blocks)

    # ---- step tables -------------------------------------------------------------------
    def step_tables(
        self,
        request_ids: Sequence[str],
        *,
        starts: Sequence[int],
        num_new_tokens: Sequence[int],
    ) -> GroupStepTables:
        """This group's block table and slot mapping for one step's packed tokens.

        Args:
            request_ids: the step's requests, in batch order.
            starts: position of each request's first new token (= its cached tokens).
            num_new_tokens: tokens each request feeds this step (>= 1).

        Returns:
            the block table of every request, and the slot of every new token unless the
            group holds per-request state (``is_token_addressed`` False).
        """
        # NOTE: the rows are the manager's own arrays, read once here: each becomes a
        # memcpy into the table, with no copy of the ids kept anywhere.
        rows = [self.req_to_blocks.get(rid, _NO_BLOCKS) for rid in request_ids]
        table = prepare_block_tables(rows)  # int32 [B, M]
        if not self.is_token_addressed:
            # One block per request holds its whole recurrent state; no token slots.
            assert all(len(r) >= 1 for r in rows), self._not_covered()
            return GroupStepTables(block_table=table, slot_mapping=None)
        if not self.has_slot_mapping:
            # Compressed rows are addressed by the model from the table (class docstring).
            kv_lens = [s + q for s, q in zip(starts, num_new_tokens, strict=True)]
            need = self.num_blocks_for
            assert all(len(r) >= need(n) for r, n in zip(rows, kv_lens, strict=True)), (
                self._not_covered()
            )
            return GroupStepTables(block_table=table, slot_mapping=None)
        slots = self._slot_mapping(rows, table, starts, num_new_tokens)
        return GroupStepTables(block_table=table, slot_mapping=slots)

    @property
    def has_slot_mapping(self) -> bool:
        """Whether each step gives this group a per-token slot mapping (token groups that
        store a row per token)."""
        return self.is_token_addressed and self.compress_ratio == 1

    def _slot_mapping(
        self,
        rows: list[array],
        table: Tensor,
        starts: Sequence[int],
        num_new_tokens: Sequence[int],
    ) -> Tensor:
        if self._standard_blocks:
            # Logical block i holds positions [i * bs, (i + 1) * bs): a row covers the step's
            # tokens exactly when its last new token's block exists, which reading the slot
            # checks. NOTE: a short row must fail here; the flat table would silently hand
            # out the next request's blocks.
            try:
                return slot_mapping_from_block_ids(rows, starts, num_new_tokens, self.block_size)
            except IndexError:
                raise AssertionError(self._not_covered()) from None
        # A type with its own num_blocks_for: check coverage by its rule, then index the
        # table token by token.
        kv_lens = [s + q for s, q in zip(starts, num_new_tokens, strict=True)]
        need = self.num_blocks_for
        assert all(len(r) >= need(n) for r, n in zip(rows, kv_lens, strict=True)), (
            self._not_covered()
        )
        request_index, positions = prepare_token_positions(
            int64_tensor(starts), int64_tensor(num_new_tokens), sum(num_new_tokens)
        )
        return prepare_slot_mapping(table, request_index, positions, self.block_size)

    def _not_covered(self) -> str:
        return (
            f"group {self.group_key!r}: a request's blocks do not cover its tokens; the KV "
            "manager allocated too few"
        )

    def num_live_blocks(self, request_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b != NULL_BLOCK_ID)

    def num_tokens(self, request_id: str) -> int:
        return self.req_to_num_tokens.get(request_id, 0)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token stays visible: the block list only grows until the request is freed."""

    attn_type = AttnType.FULL_ATTENTION.value


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query at position p sees keys (p - W, p]; older blocks go back to the pool.

    Worked example (W=4, block_size=2): with 7 tokens computed the next query is at
    position 7 and needs keys 4..7, so tokens 0..3 are skipped (7 - 4 + 1 = 4) and
    logical blocks 0 and 1 become null. After an allocation of ``n`` new tokens the live
    blocks are at most ``ceil((W - 1 + n) / block_size) + 1`` (W - 1 old keys plus the new
    tokens, possibly straddling one extra block); for decode (n=1) that is
    ``ceil(W / block_size) + 1`` however long the request runs.
    """

    attn_type = AttnType.SLIDING_WINDOW.value

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        assert self.sliding_window is not None, "SlidingWindow group built without a window"
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, hashes: Sequence[BlockHash], max_length: int) -> list[int]:
        """The longest hit whose window is cached: older blocks are not needed (null).

        A hit of L tokens lets the request compute from position L, whose query sees keys
        from ``L - W + 1`` on: only the blocks holding those must be cached. The longest L
        (in whole blocks) whose needed blocks are all cached wins, found in one pass that
        tracks the run of cached blocks ending at each candidate (blocks that slid out of
        the window of the request that made them may have been evicted since: they are not
        needed, and the hit holds null there, as the request's own table would).
        """
        pool = self.block_pool
        bs = self.block_size
        num_blocks = min(max_length // bs, len(hashes))
        found = [pool.get_cached_block(h) for h in hashes[:num_blocks]]
        run = 0  # cached blocks in a row ending just before candidate k
        best = 0
        # candidate k = hit of k blocks; needs blocks from (k*bs - W + 1) // bs to k - 1
        for k in range(1, num_blocks + 1):
            run = run + 1 if found[k - 1] is not None else 0
            first_needed = max(0, k * bs - self.sliding_window + 1) // bs
            if run >= k - first_needed:
                best = k
        if best == 0:
            return []
        first_needed = max(0, best * bs - self.sliding_window + 1) // bs
        return [NULL_BLOCK_ID] * first_needed + [
            b for b in found[first_needed:best] if b is not None
        ]

    @classmethod
    def max_blocks_per_request(
        cls,
        *,
        block_size: int,
        sliding_window: int | None,
        max_num_batched_tokens: int | None,
        next_n: int = 0,
    ) -> int | None:
        # Speculation: a verify step adds 1 + next_n tokens and the drafter's chain rows lie
        # within the next verify step's span; the framework reserves 2 * next_n window
        # tokens for the same (cache_utils.py:210-222 at fbc225d), kept here as the least a
        # step may add. Blocks are released by the accepted length only, so a rejected
        # draft never evicts a block an accepted token still reads.
        step = max_num_batched_tokens
        if step is not None and next_n:
            step = max(step, 2 * next_n)
        return window_blocks_per_request(
            sliding_window=sliding_window,
            block_size=block_size,
            max_num_batched_tokens=step,
        )


class MambaManager(SingleTypeKVCacheManager):
    """One state block per request, whatever its length (the state is overwritten in place).

    Speculative decoding (``next_n`` > 0) keeps ``1 + next_n`` blocks per request, as the
    framework's ``MambaManager`` (``single_type_kv_cache_manager.py:302-314`` at fbc225d):
    block 0 holds the request's state; a verify step of ``1 + d`` tokens reads it and writes
    the state after its token t into block t (``verify_state_table``); the accepted count
    picks the block that becomes block 0 (``keep_state_after``), a swap of two ids, no copy.
    Every step's block table carries block 0 only; the verify step gets all of them.
    """

    attn_type = AttnType.MAMBA.value
    is_token_addressed = False
    prefix_caching_unsupported = (
        "its state block is a snapshot of the whole prefix, overwritten in place (no "
        "per-block K/V to share; snapshots at block boundaries are not kept)"
    )
    # NOTE: attention computes a one-row query the same on either path; a state mixer's
    # prefill form is another formula (a chunked scan), and sources may differ between the
    # two beyond rounding: nemotron_h and zamba2 clamp dt to time_step_min in the scan only,
    # so a generated token fed through the scan moved their logits by up to 0.03.
    ride_along_unsupported = (
        "a state layer's prefill path (its chunked scan) is not its decode step: the source "
        "may compute them differently (nemotron_h and zamba2 clamp dt in the scan only), and "
        "the step carries no flag telling a generated token from a one-token prompt chunk"
    )

    def num_blocks_for(self, num_tokens: int) -> int:
        return 1 + self.next_n

    def step_tables(
        self,
        request_ids: Sequence[str],
        *,
        starts: Sequence[int],
        num_new_tokens: Sequence[int],
    ) -> GroupStepTables:
        """Block 0 of every request: its state (the other blocks serve verify steps only)."""
        tables = super().step_tables(request_ids, starts=starts, num_new_tokens=num_new_tokens)
        return GroupStepTables(block_table=tables.block_table[:, :1], slot_mapping=None)

    def verify_state_table(self, request_ids: Sequence[str], num_tokens: Sequence[int]) -> Tensor:
        """int32 ``[B, max(num_tokens)]``: the first ``num_tokens[b]`` state blocks of request
        b, then -1 (a pad id the state operators skip). Column t takes the state after the
        request's token t of a verify step; column 0 is also the state it starts from."""
        width = max(num_tokens)
        rows = []
        for rid, n in zip(request_ids, num_tokens, strict=True):
            blocks = self.req_to_blocks[rid]
            assert n <= len(blocks), (
                f"group {self.group_key!r}: a verify step of {n} tokens needs {n} state "
                f"blocks, request {rid!r} holds {len(blocks)}"
            )
            rows.append(list(blocks[:n]) + [-1] * (width - n))
        return torch.tensor(rows, dtype=torch.int32)

    def keep_state_after(self, request_id: str, token_index: int) -> None:
        """Make the state written after token ``token_index`` of the last verify step the
        request's state: its block becomes block 0 (the old block 0 becomes a spare)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or token_index == 0:
            return
        blocks[0], blocks[token_index] = blocks[token_index], blocks[0]

    @classmethod
    def max_blocks_per_request(
        cls,
        *,
        block_size: int,
        sliding_window: int | None,
        max_num_batched_tokens: int | None,
        next_n: int = 0,
    ) -> int | None:
        return 1 + next_n


class LegacyManager(SingleTypeKVCacheManager):
    """Legacy KV: each request holds one static row of ``max_model_len`` positions (its one
    block; the runtime sizes the group's block to the longest request), so token p of a
    request lives at ``row * max_model_len + p`` and the row is the request's batch slot.

    The pool holds as many rows as the budget pays for; a request waits for a free row."""

    attn_type = AttnType.LEGACY.value
    prefix_caching_unsupported = (
        "each request owns one whole static row (no per-block K/V to share between requests)"
    )

    def num_blocks_for(self, num_tokens: int) -> int:
        # a request never spans two rows: past one row no pool can hold it, which caps the
        # engine's max_model_len at the row
        return 1 if num_tokens <= self.block_size else ROW_OVERFLOW


#: what a request longer than a Legacy row would need: more blocks than any pool has
ROW_OVERFLOW = 1 << 62


#: attn_type -> manager class; extend with ``register_attn_type``
ATTN_TYPE_MANAGER_MAP: dict[str, type[SingleTypeKVCacheManager]] = {
    AttnType.FULL_ATTENTION.value: FullAttentionManager,
    AttnType.SLIDING_WINDOW.value: SlidingWindowManager,
    AttnType.MAMBA.value: MambaManager,
    AttnType.LEGACY.value: LegacyManager,
}

#: types whose per-request block count is bounded, budgeted with a fixed block count
FIXED_BLOCK_ATTN_TYPES: set[str] = {AttnType.SLIDING_WINDOW.value, AttnType.MAMBA.value}


def register_attn_type(
    attn_type: str, manager_cls: type[SingleTypeKVCacheManager], *, fixed_block: bool = False
) -> None:
    """Make ``attn_type`` a valid ``CacheEntry.attn_type`` served by ``manager_cls``."""
    if not (isinstance(manager_cls, type) and issubclass(manager_cls, SingleTypeKVCacheManager)):
        raise TypeError(f"{manager_cls!r} is not a SingleTypeKVCacheManager subclass")
    ATTN_TYPE_MANAGER_MAP[attn_type] = manager_cls
    if fixed_block:
        FIXED_BLOCK_ATTN_TYPES.add(attn_type)
    else:
        FIXED_BLOCK_ATTN_TYPES.discard(attn_type)
