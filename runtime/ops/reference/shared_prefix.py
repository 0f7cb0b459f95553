"""Paged prefill attention of requests that start with the same cached blocks.

With prefix caching, the requests of a step often share their first blocks (a system prompt,
a few-shot template): the same physical block ids lead every row of the block table. Every
query row of every such request sees all of those keys (bottom-right causality puts each
request's queries after its cached tokens), so their attention splits in two:

    keys of request b:  [ shared blocks (same ids for all) | own blocks ... its chunk ]
    out_b = merge( attn(q_b, shared keys),  attn(q_b, own keys, bottom-right causal) )

The shared half runs once for the query rows of all requests together, over keys gathered
once, instead of gathering and reading the prefix again for each request; the halves merge
by their log-sum-exps. Like ``batch_groups`` this changes only how the CPU reference spends
its time: the result is the same attention up to float summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .attention_core import attend_chunk_with_lse, flash_with_lse, merge_by_lse
from .attention_inputs import packed_index, padded_to_packed

#: the fewest shared prefix tokens worth a separate pass. Below it the per-request path's
#: extra reads cost less than one more kernel call per layer.
MIN_SHARED_TOKENS = 128

#: gathers [B, KVN, S, D] key and value for the given block-table rows and lengths
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


def attend_shared_prefix(
    q: Tensor,
    block_table: Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    shared: int,
    block_size: int,
    scale: float,
    gather: Gather,
) -> Tensor | None:
    """Bottom-right causal attention of padded queries [B, N, Sq, D] -> [B, N, Sq, Dv].

    The first ``shared`` blocks of ``block_table`` are the same for every request (see
    ``shared_blocks``). Returns None where PyTorch's CPU flash kernel (which returns the
    log-sum-exp the merge needs) is missing; the caller then takes its general path.
    """
    prefix = shared * block_size
    k_shared, v_shared = gather(block_table[:1, :shared], [prefix], "prefix")
    rows = padded_to_packed(q, q_lens)  # [T, N, D], request after request
    first = flash_with_lse(
        rows.transpose(0, 1).unsqueeze(0), k_shared, v_shared, scale, causal=False
    )
    if first is None:
        return None
    o_shared, lse_shared = first[0][0], first[1][0]  # [N, T, Dv], [N, T]
    own_lens = [kv - prefix for kv in kv_lens]
    k_own, v_own = gather(block_table[:, shared:], own_lens, "own")
    own_out, own_lse = [], []
    for i, (s1, s2) in enumerate(zip(q_lens, own_lens, strict=True)):
        if s1 == 0:
            continue
        # every row's own keys: its cached tokens after the shared blocks, then its chunk
        part = attend_chunk_with_lse(
            q[i : i + 1, :, :s1], k_own[i : i + 1, :, :s2], v_own[i : i + 1, :, :s2], scale
        )
        if part is None:
            return None
        own_out.append(part[0][0])  # [N, s1, Dv]
        own_lse.append(part[1][0])  # [N, s1]
    merged, _ = merge_by_lse(
        (o_shared, lse_shared), (torch.cat(own_out, dim=1), torch.cat(own_lse, dim=1))
    )  # [N, T, Dv]
    b, n, sq, _ = q.shape
    out = merged.new_zeros((b, sq, n, merged.size(-1)))  # padding rows stay zeros
    _, valid = packed_index(q_lens, q.device)
    out[:, : valid.size(1)][valid] = merged.transpose(0, 1)
    return out.transpose(1, 2)
