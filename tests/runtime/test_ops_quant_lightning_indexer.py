"""custom.npu_quant_lightning_indexer (+ metadata) against per-token loops: int8 scores with
dequant scales over a paged compressed key cache, the cmp_ratio causal limit, -1 tails, limits."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops.npu_standin import npu_standin
from kvskill.runtime.ops.reference import OpInputError
from kvskill.runtime.ops.reference.custom import (
    npu_quant_lightning_indexer,
    npu_quant_lightning_indexer_metadata,
)

I32, F16 = torch.int32, torch.float16
HEADS, DIM, BLOCK = 2, 8, 16


def naive(q, w, qs, keys, ks, s, tokens, ratio, mode, count):
    """One request: int8 q [S, N1, D], keys [E, D] -> [S, count] int32."""
    out = torch.full((s, count), -1, dtype=I32)
    for i in range(s):
        p = tokens - s + i
        limit = (p + 1) // ratio if mode == 3 else tokens // ratio
        scored = []
        for j in range(limit):
            total = 0.0
            for h in range(q.size(1)):
                dot = float(torch.dot(q[i, h].double(), keys[j].double()))
                total += float(w[i, h]) * max(float(qs[i, h]) * float(ks[j]) * dot, 0.0)
            scored.append((-total, j))  # descending score, lower entry first on ties
        for slot, (_, j) in enumerate(sorted(scored)[:count]):
            out[i, slot] = j
    return out


def paged_keys(entries, seed):
    """Compressed int8 keys [E, D] and fp16 scales [E] per request, shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-e // BLOCK)) for e in entries]
    order = torch.randperm(sum(need), generator=g)
    key = torch.randint(-128, 128, (sum(need), BLOCK, 1, DIM), generator=g, dtype=torch.int8)
    scale = (torch.rand(sum(need), BLOCK, 1, generator=g) + 0.5).to(F16)
    table = order.view(-1)[: sum(need)].split(need)
    width = max(need)
    table = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in table]).to(I32)
    rows = []
    for b, e in enumerate(entries):
        ids = [int(table[b, j // BLOCK]) for j in range(e)]
        rows.append((torch.stack([key[i, j % BLOCK, 0] for j, i in enumerate(ids)]) if e else key[0, :0, 0],
                     torch.stack([scale[i, j % BLOCK, 0] for j, i in enumerate(ids)]) if e else scale[0, :0, 0]))  # fmt: skip
    return key, scale, table, rows


def query(shape, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (*shape, HEADS, DIM), generator=g, dtype=torch.int8)
    w = torch.randn(*shape, HEADS, generator=g).to(F16)
    qs = (torch.rand(*shape, HEADS, generator=g) / 100).to(F16)
    return q, w, qs


def test_ratio_4_prefill_keeps_the_top_finished_entries_per_row():
    tokens, q_lens = [22, 9], [22, 3]  # request 0: whole prompt; request 1: a 3-token chunk
    key, scale, table, rows = paged_keys([n // 4 for n in tokens], seed=0)
    q, w, qs = query((sum(q_lens),), seed=1)
    idx, values = npu_quant_lightning_indexer(
        q, key, w, qs, scale, 0, 0,
        actual_seq_lengths_query=torch.tensor([22, 25], dtype=I32),  # TND: prefix sums
        actual_seq_lengths_key=torch.tensor(tokens, dtype=I32), block_table=table,
        layout_query="TND", sparse_count=3, cmp_ratio=4,
    )  # fmt: skip
    assert idx.shape == (25, 1, 3) and idx.dtype == I32 and values.numel() == 0
    for b, (start, s) in enumerate(((0, 22), (22, 3))):
        rq = slice(start, start + s)
        want = naive(q[rq], w[rq], qs[rq], *rows[b], s, tokens[b], 4, 3, 3)
        assert torch.equal(idx[rq, 0], want), (b, idx[rq, 0], want)
    assert bool((idx[:3] == -1).all())  # rows 0-2 finish no entry
    assert int((idx[4:7, 0] >= 0).sum(-1).max()) == 1  # rows 3-6: entry 0 only


def test_ratio_128_decode_through_the_dispatcher_with_its_metadata():
    tokens = [300, 129]
    key, scale, table, rows = paged_keys([n // 128 for n in tokens], seed=2)
    q, w, qs = query((2, 1), seed=3)
    lens_k = torch.tensor(tokens, dtype=I32)
    with npu_standin():
        import custom_ops  # noqa: F401

        plan = torch.ops.custom.npu_quant_lightning_indexer_metadata(
            HEADS, 1, DIM, 0, 0, actual_seq_lengths_key=lens_k, layout_key="PA_BSND",
            sparse_count=4, cmp_ratio=128,
        )  # fmt: skip
        idx, _ = torch.ops.custom.npu_quant_lightning_indexer(
            q, key, w, qs, scale, 0, 0, actual_seq_lengths_key=lens_k, block_table=table,
            metadata=plan, sparse_count=4, cmp_ratio=128,
        )  # fmt: skip
    assert idx.shape == (2, 1, 1, 4)
    for b in range(2):
        want = naive(q[b], w[b], qs[b], *rows[b], 1, tokens[b], 128, 3, 4)
        assert torch.equal(idx[b, :, 0], want)
    assert idx[0, 0, 0].tolist()[2:] == [-1, -1] and idx[1, 0, 0].tolist()[1:] == [-1, -1, -1]


def test_mode_0_sees_every_entry_and_pads_short_requests():
    tokens = [40, 40]
    key, scale, table, rows = paged_keys([10, 10], seed=4)
    q, w, qs = query((2, 3), seed=5)
    idx, _ = npu_quant_lightning_indexer(
        q, key, w, qs, scale, 0, 0, actual_seq_lengths_query=torch.tensor([3, 1], dtype=I32),
        actual_seq_lengths_key=torch.tensor(tokens, dtype=I32), block_table=table,
        sparse_count=12, sparse_mode=0, cmp_ratio=4,
    )  # fmt: skip
    assert torch.equal(idx[0, :, 0], naive(q[0], w[0], qs[0], *rows[0], 3, 40, 4, 0, 12))
    assert torch.equal(idx[1, :1, 0], naive(q[1], w[1], qs[1], *rows[1], 1, 40, 4, 0, 12))
    assert bool((idx[1, 1:] == -1).all())


def _call(**change):
    key, scale, table, _ = paged_keys([5], seed=6)
    q, w, qs = query((1, 1), seed=7)
    args = dict(
        query=q, key=key, weights=w, query_dequant_scale=qs, key_dequant_scale=scale,
        query_quant_mode=0, key_quant_mode=0, block_table=table,
        actual_seq_lengths_key=torch.tensor([20], dtype=I32), sparse_count=2, cmp_ratio=4,
    )  # fmt: skip
    args.update(change)
    return npu_quant_lightning_indexer(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query": torch.zeros(1, 1, HEADS, DIM)}, "`query` must be int8"),
        ({"cmp_ratio": 3}, "cmp_ratio must be one of"),
        ({"sparse_count": 0}, r"sparse_count must be in \[1, 2048\]"),
        ({"query_quant_mode": 1}, "query_quant_mode takes only 0"),
        ({"return_value": True}, "return_value takes only False"),
        ({"layout_key": "BSND"}, "layout_key takes only 'PA_BSND'"),
        ({"actual_seq_lengths_key": None}, "requires actual_seq_lengths_key"),
        ({"metadata": torch.zeros(1024, dtype=I32)}, "was made for num_heads_q=0"),
    ],
)
def test_documented_limits_are_refused_in_one_line(change, message):
    with pytest.raises(OpInputError, match=message):
        _call(**change)


def test_the_metadata_refuses_its_own_default_layout_key():
    # schema default 'BSND', doc (QLI metadata doc:50): only 'PA_BSND'
    with pytest.raises(OpInputError, match="layout_key takes only 'PA_BSND'"):
        npu_quant_lightning_indexer_metadata(HEADS, 1, DIM, 0, 0)


def test_the_fake_gives_the_documented_shape():
    meta = {"device": "meta"}
    with npu_standin():
        idx, values = torch.ops.custom.npu_quant_lightning_indexer(
            torch.empty(7, HEADS, DIM, dtype=torch.int8, **meta),
            torch.empty(2, BLOCK, 1, DIM, dtype=torch.int8, **meta),
            torch.empty(7, HEADS, dtype=F16, **meta), torch.empty(7, HEADS, dtype=F16, **meta),
            torch.empty(2, BLOCK, 1, dtype=F16, **meta), 0, 0, layout_query="TND",
            sparse_count=5, cmp_ratio=4,
        )  # fmt: skip
    assert idx.shape == (7, 1, 5) and idx.dtype == I32 and values.shape == (0,)
