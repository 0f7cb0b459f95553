"""Which requests of a paged fused-attention call the reference computes together.

The reference pads every request of a group to the group's longest query and longest KV, and
gathers the group's paged KV into one dense tensor. One group for the whole batch wastes work
on padding when lengths differ (a decode batch with 16- and 380-token histories pays 380 for
both); one group per request wastes fixed per-call cost. This picks a partition in between
from a small cost model. It changes only how the CPU reference spends its time: every
partition computes the same attention (up to float summation order).

    kv_lens (decode, sorted)  380 371 300 | 210 190 | 60 41 16
    groups                    pad to 380  | to 210  | to 60
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

#: fixed cost of one more group (index, gather, mask and kernel launches), in the units of
#: ``_cost``: multiply-adds of q.k for one head and one head-dim element. Measured on a
#: 2-core x86 CPU with fp32: a group costs about 60-100 us, a q.k element about 0.6-1 ns.
GROUP_OVERHEAD = 100_000
#: the most groups considered (quantile splits of the sorted requests)
MAX_GROUPS = 8


@dataclass(frozen=True)
class Group:
    """Some requests of the call, computed together (cached: never modify its tensor)."""

    #: the requests' positions in the call's batch
    members: tuple[int, ...]
    q_lens: list[int]
    kv_lens: list[int]
    #: ``members`` as an int64 index tensor
    index: Tensor


def plan_groups(
    q_lens: list[int], kv_lens: list[int], heads_x_dim: int, device: torch.device
) -> tuple[Group, ...] | None:
    """The request groups, or None when the whole batch is best computed at once.

    Args:
        q_lens, kv_lens: per-request lengths of the call.
        heads_x_dim: query heads x head dim; scales the per-pair cost against the fixed cost.
    """
    if len(q_lens) < 2 or (min(kv_lens) == max(kv_lens) and min(q_lens) == max(q_lens)):
        return None  # nothing to save: no request is padded
    # Every layer of a model step asks with the same lengths: plan once per step.
    return _plan(tuple(q_lens), tuple(kv_lens), heads_x_dim, device)


@lru_cache(maxsize=32)
def _plan(
    q_lens: tuple[int, ...], kv_lens: tuple[int, ...], heads_x_dim: int, device: torch.device
) -> tuple[Group, ...] | None:
    batch = len(q_lens)
    # Longest work first, so each quantile split starts at its group's longest request.
    order = sorted(range(batch), key=lambda b: (q_lens[b] * kv_lens[b], kv_lens[b]), reverse=True)
    cost_of = _decode_cost if max(q_lens) == 1 else _cost
    best_k, best_cost = 1, cost_of((tuple(order),), q_lens, kv_lens, heads_x_dim)
    for k in range(2, min(batch, MAX_GROUPS) + 1):
        cost = cost_of(_split(order, k), q_lens, kv_lens, heads_x_dim)
        if cost < best_cost:
            best_k, best_cost = k, cost
    if best_k == 1:
        return None
    return tuple(
        Group(
            members=members,
            q_lens=[q_lens[b] for b in members],
            kv_lens=[kv_lens[b] for b in members],
            index=torch.tensor(members, dtype=torch.int64, device=device),
        )
        for members in _split(order, best_k)
    )


def _split(order: list[int], k: int) -> tuple[tuple[int, ...], ...]:
    n = len(order)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return tuple(tuple(order[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a)


def _decode_cost(
    groups: tuple[tuple[int, ...], ...], q_lens: tuple[int, ...], kv_lens: tuple[int, ...], hd: int
) -> float:
    """``_cost`` for one query row per request: each group's first member is its longest."""
    return sum(len(g) * kv_lens[g[0]] * hd + GROUP_OVERHEAD for g in groups)


def _cost(
    groups: tuple[tuple[int, ...], ...], q_lens: tuple[int, ...], kv_lens: tuple[int, ...], hd: int
) -> float:
    total = 0.0
    for group in groups:
        max_q = max(q_lens[b] for b in group)
        max_kv = max(kv_lens[b] for b in group)
        pairs = len(group) * max_q * max_kv
        if all(q_lens[b] == kv_lens[b] == max_q for b in group):
            # Equal full causal squares run the kernel's causal path: half the pairs.
            pairs //= 2
        elif len(group) == 1 and max_q < max_kv:
            # A lone chunk after cached keys: the prefix in full, the chunk causally.
            pairs = max_q * (max_kv - max_q) + max_q * max_q // 2
        total += pairs * hd + GROUP_OVERHEAD
    return total
