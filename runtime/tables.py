"""Block tables and slot mappings for one step, with no per-token Python work.

Worked example (block_size=4). Request 0 has blocks [7, 2] and 6 cached tokens, request 1
has block [5] and 2 cached tokens; this step each adds one token (decode):

    block_table = [[7, 2],          # request 0: logical block 0 -> physical 7, 1 -> 2
                   [5, 0]]          # request 1: padded with the null block 0
    request_index = [0, 1]          # which request each packed token belongs to
    positions     = [6, 2]          # token position inside its request

    slot = block_table[req, pos // 4] * 4 + pos % 4
         = [block_table[0, 1] * 4 + 2, block_table[1, 0] * 4 + 2]
         = [2 * 4 + 2, 5 * 4 + 2] = [10, 22]

Token 6 of request 0 lands in row 2 of physical block 2 (flat slot 10 of a
``[num_blocks * block_size, heads, dim]`` view of the cache).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvskill.runtime.block_pool import NULL_BLOCK_ID
from torch import Tensor

#: block ids are kept as C ints (``array("i")``) and read back as int32
_C_INT_BYTES = array("i").itemsize
assert _C_INT_BYTES == 4, "block tables read array('i') buffers as int32"


@dataclass(frozen=True, slots=True)
class GroupStepTables:
    """One group's tables for one step, built by the manager that owns the block ids."""

    #: int32 ``[B, M]``: row b is request b's block ids in logical order, null-padded
    block_table: Tensor
    #: int64 ``[T]``: the physical slot of every packed token; None for a state group
    #: (Mamba), whose ``block_table[:, 0]`` is each request's state index instead
    slot_mapping: Tensor | None


@dataclass(frozen=True, slots=True)
class StepTables:
    """Every group's block table and every token group's slot mapping for one step.

    Keyed by group key (the ``attn_type`` or ``manager_key``), as ``ForwardMetaData`` and
    the converted attention read them: ``block_table[key]``, ``slot_mapping[key]``.
    """

    block_table: dict[str, Tensor]
    #: token groups only: a state group has a block table and no slots
    slot_mapping: dict[str, Tensor]


def prepare_block_tables(
    block_ids: Sequence[Sequence[int]],
    device: str | torch.device | None = None,
    pad_to: int | None = None,
) -> Tensor:
    """Stack per-request block id lists into an int32 ``[B, max_len]`` table.

    Args:
        block_ids: one list (or ``array``) per request, logical order (null 0 where a block
            was released).
        device: where the table lives.
        pad_to: minimum width (e.g. a fixed max blocks per request); rows are padded with
            the null block 0.

    Returns:
        int32 ``[B, max(pad_to, longest list)]``.
    """
    width = max(map(len, block_ids), default=0)
    if pad_to is not None:
        width = max(width, pad_to)
    if not block_ids or width == 0:
        table = torch.zeros((len(block_ids), width), dtype=torch.int32)
        return table if device is None else table.to(device)
    # Rows are copied into one zero-filled (null block) C int buffer that the table wraps
    # without a copy. For the KV managers' own ``array("i")`` rows each copy is a memcpy; a
    # list row is converted first (in C, no torch.tensor(list) walk).
    assert NULL_BLOCK_ID == 0, "the zero-filled buffer is the null-block padding"
    flat = array("i", bytes(len(block_ids) * width * _C_INT_BYTES))
    start = 0
    for ids in block_ids:
        if type(ids) is not array or ids.typecode != "i":
            ids = array("i", ids)
        flat[start : start + len(ids)] = ids
        start += width
    table = torch.frombuffer(flat, dtype=torch.int32).view(len(block_ids), width)  # [B, M]
    return table if device is None else table.to(device)


def prepare_slot_mapping(
    block_table: Tensor, request_index: Tensor, positions: Tensor, block_size: int
) -> Tensor:
    """Physical slot of every packed token: ``block_table[b, pos // bs] * bs + pos % bs``.

    Args:
        block_table: int32 ``[B, M]`` from ``prepare_block_tables``.
        request_index: int32 or int64 ``[T]``, the batch row of each token.
        positions: int32 or int64 ``[T]``, each token's position inside its request.
        block_size: tokens per block of this group.

    Returns:
        int64 ``[T]``.
    """
    # NOTE: index math runs in int32: half the memory traffic of int64 on these [T] passes,
    # which dominates for large packed steps. Positions and B * M stay far below 2**31; only
    # the final slot (block id * block_size) is formed in int64.
    device = block_table.device
    positions = positions.to(device, torch.int32)
    request_index = request_index.to(device, torch.int32)
    if block_size & (block_size - 1) == 0:
        # Power of two (the usual case): shift and mask instead of integer division.
        logical_block = positions >> (block_size.bit_length() - 1)  # [T]
        offset = positions & (block_size - 1)  # [T]
    else:
        logical_block = torch.div(positions, block_size, rounding_mode="floor")
        offset = positions - logical_block * block_size
    # A position past the table's width would wrap into the next row of the flat index below
    # and silently read another request's block: one reduction guards against it.
    if logical_block.numel() and int(logical_block.max()) >= block_table.shape[1]:
        raise ValueError(
            f"a position needs logical block {int(logical_block.max())} but the block table "
            f"has {block_table.shape[1]} columns; allocate slots before building the mapping "
            "(state groups such as Mamba have no slot mapping)"
        )
    # Row-major flat index into the table; index_select is much cheaper than 2-D indexing.
    flat_index = request_index * block_table.shape[1]
    flat_index += logical_block  # [T]
    block = block_table.reshape(-1).index_select(0, flat_index)  # int32 [T]
    return block.to(torch.int64) * block_size + offset


def prepare_token_positions(
    num_computed_tokens: Tensor,
    num_new_tokens: Tensor,
    num_tokens: int | None = None,
    dtype: torch.dtype = torch.int64,
) -> tuple[Tensor, Tensor]:
    """``(request_index, positions)`` of the packed tokens of one step.

    Request b contributes positions ``num_computed_tokens[b] .. + num_new_tokens[b] - 1``.
    Example: computed [6, 0], new [1, 3] -> request_index [0, 1, 1, 1], positions [6, 0, 1, 2].

    Args:
        num_computed_tokens: int ``[B]``, tokens already in the cache.
        num_new_tokens: int ``[B]``, tokens of this step (0 allowed).
        num_tokens: T = ``num_new_tokens.sum()`` when the caller knows it (saves one sync).
        dtype: of both results; int32 skips two conversion passes when the caller only
            feeds them to ``prepare_slot_mapping``.

    Returns:
        ``request_index [T]`` and ``positions [T]``.
    """
    device = num_new_tokens.device
    num_new_tokens = num_new_tokens.to(torch.int32)
    total = int(num_new_tokens.sum()) if num_tokens is None else num_tokens
    first_token = torch.cumsum(num_new_tokens, 0, dtype=torch.int32) - num_new_tokens  # [B]
    # request_index = (request starts at or before each token) - 1: mark each start (requests
    # with no tokens share their successor's start, so index_add_ counts them) and scan.
    # Trailing empty requests start at T: the extra last cell takes them, no masking sync.
    marks = torch.zeros(total + 1, dtype=torch.int32, device=device)
    marks.index_add_(0, first_token, torch.ones_like(first_token))
    request_index = torch.cumsum(marks[:total], 0, dtype=torch.int32)
    request_index -= 1  # [T]
    # position = packed token index + (computed - packed start) of its request
    shift = num_computed_tokens.to(device, torch.int32) - first_token  # [B]
    positions = torch.arange(total, dtype=torch.int32, device=device)
    positions += shift.index_select(0, request_index)  # [T]
    return request_index.to(dtype), positions.to(dtype)


def int64_tensor(values: Sequence[int] | array) -> Tensor:
    """A CPU int64 tensor of ``values`` through an ``array`` buffer.

    ``torch.tensor(list)`` inspects every element as a Python object; packing the list into a
    typed array first and wrapping its buffer costs about a third of that for step-sized lists.
    """
    buffer = values if isinstance(values, array) and values.typecode == "q" else array("q", values)
    if not buffer:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(buffer, dtype=torch.int64)


def slot_mapping_from_block_ids(
    block_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
) -> Tensor:
    """Physical slot of every packed token, read from the block id lists themselves.

    Equivalent to ``prepare_slot_mapping(prepare_block_tables(block_ids), ...)`` for tokens
    ``starts[b] .. starts[b] + num_new_tokens[b] - 1`` of each request b, without the
    intermediate tensors: the slots of one request inside one block are a contiguous range,
    so the work is per block touched (one per request in a decode step), not per token.

    Args:
        block_ids: one list per request, logical order.
        starts: position of each request's first new token.
        num_new_tokens: new tokens per request this step (>= 1).
        block_size: tokens per block of this group.

    Returns:
        int64 ``[T]``, T = ``sum(num_new_tokens)``.

    Raises:
        IndexError: when a request's list does not reach its last new token (the caller
            allocated too few blocks).
    """
    bs = block_size
    if all(q == 1 for q in num_new_tokens):
        # Decode: one token per request.
        slots = array(
            "q", [ids[p // bs] * bs + p % bs for ids, p in zip(block_ids, starts, strict=True)]
        )
        return int64_tensor(slots)
    slots = array("q")
    for ids, start, count in zip(block_ids, starts, num_new_tokens, strict=True):
        stop = start + count
        logical = start // bs
        pos = start
        while pos < stop:
            end = min(stop, (logical + 1) * bs)
            shift = (ids[logical] - logical) * bs  # slot = block * bs + (pos - logical * bs)
            slots.extend(range(shift + pos, shift + end))
            pos = end
            logical += 1
    return int64_tensor(slots)


def bool_tensor(values: Sequence[bool]) -> Tensor:
    """A CPU bool tensor of ``values`` (one byte each) through an ``array`` buffer."""
    if not values:
        return torch.zeros(0, dtype=torch.bool)
    return torch.frombuffer(array("B", values), dtype=torch.bool)
