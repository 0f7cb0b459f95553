"""Paged prefill of a TND call, on the packed query rows as they come.

What a converted model's prefill step asks: query rows of several requests packed one after
another ([T, N, D]), each request's keys in the paged cache, plain bottom-right causality
(sparse mode 3), no lse. The general path pads every request to the longest one (query,
gathered keys and output) and masks; here each request runs on its own rows and its own
keys, and the output is written packed, as the operator returns it:

    rows  [ r0: s1=40 | r1: s1=3 | r2: s1=120 ]      keys of r_b: its kv_len_b cached tokens
    r_b:  flash(q rows, first kv_len_b - s1 keys, no mask)   merged by log-sum-exp with
          flash(q rows, its own s1 keys, causal)

Requests that start with the same cached blocks (prefix caching: a system prompt, a
few-shot template) share more: every query row of every such request sees all of those
keys, so that part runs once for all their rows over keys gathered once:

    keys of request b:  [ shared blocks (same ids for all) | own blocks ... its chunk ]
    out_b = merge( attn(q_b, shared keys),  attn(q_b, own keys, bottom-right causal) )

Like ``batch_groups`` this changes only how the CPU reference spends its time: the result is
the same attention up to float summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .attention_core import attend_chunk_with_lse, flash_with_lse, merge_by_lse

#: the fewest shared prefix tokens worth a separate pass. Below it the per-request path's
#: extra reads cost less than one more kernel call per layer.
MIN_SHARED_TOKENS = 128

#: gathers [B, KVN, S, D] fp32 key and value for block-table rows, lengths and a role name
Gather = Callable[[Tensor, list[int], str], tuple[Tensor, Tensor]]


def shared_blocks(
    block_table: Tensor, q_lens: list[int], kv_lens: list[int], block_size: int
) -> int:
    """How many leading blocks every request shares and every one of its query rows sees.

    Capped by the shortest cached part (kv_len - q_len) over the requests, so that no query
    row of any request sits inside the shared blocks; 0 when that is under
    ``MIN_SHARED_TOKENS`` or fewer than two requests take part.
    """
    if len(q_lens) < 2 or block_size <= 0:
        return 0
    cap = min(kv - q for q, kv in zip(q_lens, kv_lens, strict=True)) // block_size
    cap = min(cap, block_table.size(1))
    if cap * block_size < MIN_SHARED_TOKENS:
        return 0
    same = (block_table[:, :cap] == block_table[:1, :cap]).all(dim=0)
    if bool(same.all()):
        return cap
    count = int(same.to(torch.int8).argmin())  # the first column where some row differs
    return count if count * block_size >= MIN_SHARED_TOKENS else 0


def attend_packed(
    rows: Tensor,
    block_table: Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    block_size: int,
    scale: float,
    gather: Gather,
) -> Tensor | None:
    """Bottom-right causal attention of packed fp32 query rows [T, N, D] -> [T, N, Dv].

    Every request needs 1 <= q_len <= kv_len. Returns None where PyTorch's CPU flash kernel
    (which returns the log-sum-exp the merges need) is missing; the caller then takes its
    general path.
    """
    shared = shared_blocks(block_table, q_lens, kv_lens, block_size)
    prefix = shared * block_size
    base = None
    if shared:
        k_shared, v_shared = gather(block_table[:1, :shared], [prefix], "prefix")
        base = flash_with_lse(
            rows.transpose(0, 1).unsqueeze(0), k_shared, v_shared, scale, causal=False
        )
        if base is None:
            return None
    own_lens = [kv - prefix for kv in kv_lens]
    table = block_table[:, shared:]  # each request's own blocks
    out: Tensor | None = None
    start = 0
    for b, (s1, s2) in enumerate(zip(q_lens, own_lens, strict=True)):
        k, v = gather(table[b : b + 1], [s2], "own")
        q = rows[start : start + s1].transpose(0, 1).unsqueeze(0)  # [1, N, s1, D], a view
        part = attend_chunk_with_lse(q, k, v, scale)
        if part is None:
            return None
        if base is not None:
            shared_part = (base[0][:, :, start : start + s1], base[1][:, :, start : start + s1])
            part = merge_by_lse(shared_part, part)
        if out is None:
            out = rows.new_empty((rows.size(0), rows.size(1), part[0].size(-1)))
        out[start : start + s1] = part[0][0].transpose(0, 1)
        start += s1
    return out
