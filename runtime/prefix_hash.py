"""Block hashes for prefix caching: a chain over full blocks, one chain per cache group.

The hash of logical block i of a request names everything its K/V depend on: the tokens
of blocks 0..i (through the parent's hash) and the group (the chain's root), so two
requests get the same hash for block i exactly when they share the first ``(i + 1) *
block_size`` tokens, and a hash from one group never matches a block of another (a shared
page pool holds blocks of every group). SHA-256 keeps collisions out of the question: a
collision would hand a request someone else's K/V silently.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Protocol

BlockHash = bytes


class HashableRequest(Protocol):
    """What hashing reads from a request (``Request`` has it)."""

    request_id: str
    block_hashes: dict[str, list[BlockHash]]

    @property
    def num_tokens(self) -> int: ...

    def token_ids_slice(self, start: int, stop: int) -> list[int]: ...


def root_hash(group_key: str) -> BlockHash:
    """The parent hash of a request's first block in group ``group_key``."""
    return hashlib.sha256(b"kvskill-prefix-cache\0" + group_key.encode()).digest()


def chain_hash(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """The hash of a full block: its parent's hash and its token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def block_hashes(
    request: HashableRequest, group_key: str, block_size: int, num_blocks: int
) -> list[BlockHash]:
    """The request's first ``num_blocks`` block hashes in the group (computed once, kept on
    the request: its tokens never change, only grow)."""
    hashes = request.block_hashes.setdefault(group_key, [])
    if len(hashes) < num_blocks:
        parent = hashes[-1] if hashes else root_hash(group_key)
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(
                parent, request.token_ids_slice(i * block_size, (i + 1) * block_size)
            )
            hashes.append(parent)
    return hashes
