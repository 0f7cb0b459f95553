"""A rank's rows of a fused q/k/v weight, checked against the layouts built naively here:
every row is labelled with the head it belongs to, and a rank must get exactly its own
heads, in the order its forward cuts them (the source's layout over fewer heads)."""

import pytest
import torch
from kvskill.core.errors import UnsupportedModelError
from kvskill.runtime.distributed.fused_qkv import FusedQkvShape, fused_qkv_rows
from kvskill.runtime.distributed.shard import Slice


def _labels(layout: str, heads: int, kv: int, q_heads: list[int], kv_heads: list[int]) -> list:
    """Rows (one per head, head_dim 1) of LAYOUT holding the given query and KV heads."""
    group = heads // kv
    if layout == "contiguous":
        return (
            [("q", h) for h in q_heads]
            + [("k", h) for h in kv_heads]
            + [("v", h) for h in kv_heads]
        )
    if layout == "per_head":
        return [(kind, h) for h in q_heads for kind in ("q", "k", "v")]
    rows = []
    for g in kv_heads:  # per KV group: its queries (those listed), its key, its value
        rows += [("q", h) for h in q_heads if h // group == g] + [("k", g), ("v", g)]
    return rows


def _rank_rows(layout: str, heads: int, kv: int, rank: int, tp: int, head_dim: int) -> list:
    whole = _labels(layout, heads, kv, list(range(heads)), list(range(kv)))
    rows = [label for label in whole for _ in range(head_dim)]  # head_dim rows per head
    shape = FusedQkvShape(heads=heads, kv_heads=kv, head_dim=head_dim)
    ranges = fused_qkv_rows(layout, shape, rank=rank, tp=tp, name="attn.wqkv")
    taken = Slice(0, ranges).take(torch.arange(len(rows))).tolist()
    return [rows[i] for i in taken[::head_dim]]


@pytest.mark.parametrize(
    ("layout", "heads", "kv", "tp"),
    [
        ("contiguous", 4, 2, 2),
        ("contiguous", 8, 2, 4),  # KV heads replicated: one per rank
        ("per_kv_group", 4, 2, 2),
        ("per_kv_group", 8, 4, 2),  # two groups per rank
        ("per_kv_group", 4, 2, 4),  # one group shared by two ranks
        ("per_kv_group", 4, 1, 2),  # multi-query: the one group split
        ("per_head", 4, 4, 2),
    ],
)
def test_each_rank_gets_its_own_heads_in_the_source_order(layout, heads, kv, tp):
    for rank in range(tp):
        q_heads = list(range(rank * heads // tp, (rank + 1) * heads // tp))
        if tp <= kv:
            kv_heads = list(range(rank * kv // tp, (rank + 1) * kv // tp))
        else:
            kv_heads = [rank * kv // tp]
        expected = _labels(layout, heads, kv, q_heads, kv_heads)
        assert _rank_rows(layout, heads, kv, rank, tp, head_dim=3) == expected


def test_a_per_group_weight_cut_by_thirds_mixes_heads():
    """What a split blind to the order does: the contiguous rule on per-group rows
    [q0 q1 k0 v0 | q2 q3 k1 v1] hands rank 0 query head 2 as its key and group 1's key as
    its value, and nothing fails."""
    whole = _labels("per_kv_group", 4, 2, list(range(4)), [0, 1])
    shape = FusedQkvShape(heads=4, kv_heads=2, head_dim=1)
    ranges = fused_qkv_rows("contiguous", shape, rank=0, tp=2, name="attn.wqkv")
    taken = [whole[i] for i in Slice(0, ranges).take(torch.arange(len(whole))).tolist()]
    assert taken == [("q", 0), ("q", 1), ("q", 2), ("k", 1)]
    assert taken != _labels("per_kv_group", 4, 2, [0, 1], [0])


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            None,
            "attn.wqkv projects query, key and value in one Linear and its attention declares no row order",
        ),
        ("unknown", "declares 'unknown'"),
    ],
)
def test_an_order_not_declared_is_refused_in_one_line(layout, message):
    shape = FusedQkvShape(heads=4, kv_heads=2, head_dim=8)
    with pytest.raises(UnsupportedModelError, match=message) as caught:
        fused_qkv_rows(layout, shape, rank=0, tp=2, name="attn.wqkv")
    assert "\n" not in str(caught.value) and "--tp 1" in str(caught.value)


def test_per_head_rows_need_one_kv_head_per_query_head():
    shape = FusedQkvShape(heads=4, kv_heads=2, head_dim=8)
    with pytest.raises(UnsupportedModelError, match="per_head"):
        fused_qkv_rows("per_head", shape, rank=0, tp=2, name="attn.query_key_value")
