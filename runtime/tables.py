"""Block tables and slot mappings for one step, built with tensor ops (no per-token loops).

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
from itertools import chain

import torch
from kvskill.runtime.block_pool import NULL_BLOCK_ID
from torch import Tensor


def prepare_block_tables(
    block_ids: Sequence[Sequence[int]],
    device: str | torch.device | None = None,
    pad_to: int | None = None,
) -> Tensor:
    """Stack per-request block id lists into an int32 ``[B, max_len]`` table.

    Args:
        block_ids: one list per request, logical order (null 0 where a block was released).
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
    # The ids arrive as Python lists, so one pass over them is unavoidable; padding each row
    # with a slice of a shared zero list and reading the buffer with frombuffer keeps that
    # pass in C (no per-element Python work, no torch.tensor(list) walk).
    zeros = [NULL_BLOCK_ID] * width
    flat = array("i", chain.from_iterable(chain(ids, zeros[len(ids) :]) for ids in block_ids))
    table = torch.frombuffer(flat, dtype=torch.int32).view(len(block_ids), width)  # [B, M]
    return table if device is None else table.to(device)


def prepare_slot_mapping(
    block_table: Tensor, request_index: Tensor, positions: Tensor, block_size: int
) -> Tensor:
    """Physical slot of every packed token: ``block_table[b, pos // bs] * bs + pos % bs``.

    Args:
        block_table: int32 ``[B, M]`` from ``prepare_block_tables``.
        request_index: int64 ``[T]``, the batch row of each token.
        positions: int64 ``[T]``, each token's position inside its request (0-based).
        block_size: tokens per block of this group.

    Returns:
        int64 ``[T]``.
    """
    positions = positions.to(block_table.device, torch.int64)
    request_index = request_index.to(block_table.device, torch.int64)
    block = block_table[request_index, positions // block_size].to(torch.int64)  # [T]
    return block * block_size + positions % block_size


def prepare_token_positions(
    num_computed_tokens: Tensor, num_new_tokens: Tensor
) -> tuple[Tensor, Tensor]:
    """``(request_index, positions)`` of the packed tokens of one step.

    Request b contributes positions ``num_computed_tokens[b] .. + num_new_tokens[b] - 1``.
    Example: computed [6, 0], new [1, 3] -> request_index [0, 1, 1, 1], positions [6, 0, 1, 2].

    Args:
        num_computed_tokens: int64 ``[B]``, tokens already in the cache.
        num_new_tokens: int64 ``[B]``, tokens of this step.
    """
    num_new_tokens = num_new_tokens.to(torch.int64)
    device = num_new_tokens.device
    batch = torch.arange(num_new_tokens.numel(), device=device)
    request_index = torch.repeat_interleave(batch, num_new_tokens)  # [T]
    # position = token index in the packed step + (computed - first packed index), per request
    first_token = torch.cumsum(num_new_tokens, 0) - num_new_tokens  # [B]
    shift = num_computed_tokens.to(device, torch.int64) - first_token  # [B]
    positions = torch.arange(request_index.numel(), device=device)
    positions += torch.repeat_interleave(shift, num_new_tokens)
    return request_index, positions
