"""The rows of a fused query/key/value projection that one tensor-parallel rank keeps.

One Linear's shape is the same whatever order its rows run in; the converted attention
declares the order its forward cuts them by (``self.fused_qkv_layout``, read by the analyzer
from that cut). Worked example, 4 query heads, 2 KV heads (G = 2 queries per group), tp 2,
rows in units of head_dim, rank 1's rows marked ``*``::

    contiguous    q0 q1 q2* q3* | k0 k1* | v0 v1*      -> (2, 4), (5, 6), (7, 8)
    per_kv_group  q0 q1 k0 v0 | q2* q3* k1* v1*        -> (4, 8)
    per_head      (MHA only) q0 k0 v0 | q1 k1 v1 | ...  -> rank's heads, 3 rows each

When tp exceeds the KV heads every rank keeps one KV head, ``rank * kv // tp``, with its own
share of that group's queries (tp 4 above: rank 1 keeps q1, k0, v0).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvskill.core.errors import UnsupportedModelError

#: the layouts a rank's rows can be read for
SPLITTABLE = ("contiguous", "per_head", "per_kv_group")


@dataclass(frozen=True, kw_only=True)
class FusedQkvShape:
    heads: int
    kv_heads: int
    head_dim: int


def fused_qkv_rows(
    layout: str | None, shape: FusedQkvShape, *, rank: int, tp: int, name: str
) -> tuple[tuple[int, int], ...]:
    """Row ranges (start, stop) of the fused weight that RANK of TP keeps, in the order the
    rank's forward cuts them (its q heads, then k, then v, as the source does).

    Raises UnsupportedModelError (one line, naming the layout) when the order is not
    declared or cannot be split: a split by thirds or by head ranges of the wrong order
    hands a rank another head's keys and still runs to the end."""
    if layout not in SPLITTABLE:
        said = f"declares {layout!r}" if layout else "declares no row order"
        raise UnsupportedModelError(
            f"{name} projects query, key and value in one Linear and its attention {said} "
            f"(fused_qkv_layout: one of {', '.join(SPLITTABLE)}, read from the code that "
            "cuts it; Legacy conversions declare none); without it the rows of a rank's "
            "heads are unknown, run with --tp 1"
        )
    d, heads, kv = shape.head_dim, shape.heads, shape.kv_heads
    if layout == "per_head":
        if kv != heads:
            raise UnsupportedModelError(
                f"{name}: a per_head fused q/k/v layout (q, k, v rows side by side per head) "
                f"with {kv} KV heads for {heads} query heads is not a layout tensor "
                "parallelism recognises; run with --tp 1"
            )
        per = heads // tp
        return ((rank * per * 3 * d, (rank + 1) * per * 3 * d),)
    q_first, q_count, kv_first, kv_count = _rank_heads(heads, kv, rank=rank, tp=tp)
    if layout == "contiguous":
        return (
            (q_first * d, (q_first + q_count) * d),
            ((heads + kv_first) * d, (heads + kv_first + kv_count) * d),
            ((heads + kv + kv_first) * d, (heads + kv + kv_first + kv_count) * d),
        )
    group = heads // kv + 2  # rows of one KV group: its queries, its key, its value
    if kv_count > 1 or tp <= kv:
        return ((kv_first * group * d, (kv_first + kv_count) * group * d),)
    # one group shared by several ranks: this rank's queries of it, then its key and value
    base = kv_first * group
    offset = q_first - kv_first * (heads // kv)
    return (
        ((base + offset) * d, (base + offset + q_count) * d),
        ((base + group - 2) * d, (base + group) * d),
    )


def _rank_heads(heads: int, kv: int, *, rank: int, tp: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of RANK; KV heads are
    replicated one per rank when tp exceeds them (shard.check_tp_size allows only multiples)."""
    per_q = heads // tp
    if tp <= kv:
        per_kv = kv // tp
        return rank * per_q, per_q, rank * per_kv, per_kv
    return rank * per_q, per_q, rank * kv // tp, 1
