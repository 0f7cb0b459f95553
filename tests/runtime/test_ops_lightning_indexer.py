"""npu_lightning_indexer against naive loops: scores, causal rows, -1 tails, layouts, limits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import OpInputError
from kvskill.runtime.ops.reference.npu_profile import npu_limits

I32 = torch.int32


def naive_indexer(q, k, w, q_len, kv_len, sparse_count, sparse_mode):
    """One request: q [S1, N1, D], k [S2, 1, D], w [S1, N1] -> [S1, 1, sparse_count] int32."""
    out = torch.full((q.size(0), 1, sparse_count), -1, dtype=I32)
    for i in range(q_len):
        visible = kv_len if sparse_mode == 0 else kv_len - q_len + i + 1
        scored = []
        for j in range(max(visible, 0)):
            total = 0.0
            for h in range(q.size(1)):
                dot = float(torch.dot(q[i, h].double(), k[j, 0].double()))
                total += float(w[i, h]) * max(dot, 0.0)
            scored.append((-total, j))  # descending score, lower position first on ties
        scored.sort()
        for slot, (_, j) in enumerate(scored[:sparse_count]):
            out[i, 0, slot] = j
    return out


def make(seed, b=2, s1=5, s2=9, n1=4, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s1, n1, d, generator=g)
    k = torch.randn(b, s2, 1, d, generator=g)
    w = torch.randn(b, s1, n1, generator=g)
    return q, k, w


@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("sparse_count", [3, 9, 16])
def test_bsnd_matches_the_naive_top_k(sparse_mode, sparse_count):
    q, k, w = make(0)
    q_lens, kv_lens = [5, 3], [9, 6]
    idx, values = npu.npu_lightning_indexer(
        q, k, w,
        actual_seq_lengths_query=torch.tensor(q_lens, dtype=I32),
        actual_seq_lengths_key=torch.tensor(kv_lens, dtype=I32),
        sparse_count=sparse_count, sparse_mode=sparse_mode,
    )  # fmt: skip
    assert idx.shape == (2, 5, 1, sparse_count) and idx.dtype == I32
    assert values.numel() == 0
    for b in range(2):
        want = naive_indexer(q[b], k[b], w[b], q_lens[b], kv_lens[b], sparse_count, sparse_mode)
        assert torch.equal(idx[b], want), (b, idx[b], want)
    # padded query rows of request 1 (rows 3, 4) hold only -1
    assert bool((idx[1, 3:] == -1).all())


def test_top_k_really_drops_positions_when_the_sequence_is_longer():
    q, k, w = make(1, b=1, s1=1, s2=12)
    idx, _ = npu.npu_lightning_indexer(q, k, w, sparse_count=4, sparse_mode=0)
    chosen = idx[0, 0, 0].tolist()
    assert len(set(chosen)) == 4 and -1 not in chosen
    # the kept four are the four best scores and every dropped key scores lower
    scores = (torch.relu(torch.einsum("hd,td->ht", q[0, 0], k[0, :, 0])) * w[0, 0].view(-1, 1)).sum(
        0
    )
    dropped = [j for j in range(12) if j not in chosen]
    assert min(scores[chosen]) >= max(scores[dropped])
    assert chosen == sorted(chosen, key=lambda j: -float(scores[j]))


def test_causal_rows_keep_valid_positions_in_front_and_minus_one_after():
    q, k, w = make(2, b=1, s1=4, s2=4)
    idx, _ = npu.npu_lightning_indexer(q, k, w, sparse_count=6, sparse_mode=3)
    for i in range(4):
        row = idx[0, i, 0].tolist()
        assert sorted(row[: i + 1]) == list(range(i + 1))  # row i sees keys 0..i
        assert row[i + 1 :] == [-1] * (6 - i - 1)


def test_ties_go_to_the_lower_position():
    # negative dots: relu makes every score 0, so the order is the positions' own
    q = torch.ones(1, 1, 2, 4)
    k = -torch.ones(1, 6, 1, 4)
    w = torch.ones(1, 1, 2)
    idx, _ = npu.npu_lightning_indexer(q, k, w, sparse_count=4, sparse_mode=0)
    assert idx[0, 0, 0].tolist() == [0, 1, 2, 3]


def test_tnd_and_paged_keys_give_the_bsnd_answer():
    q, k, w = make(3, b=2, s1=3, s2=10)
    q_lens, kv_lens = [3, 2], [10, 7]
    ref, _ = npu.npu_lightning_indexer(
        q, k, w,
        actual_seq_lengths_query=torch.tensor(q_lens, dtype=I32),
        actual_seq_lengths_key=torch.tensor(kv_lens, dtype=I32), sparse_count=5,
    )  # fmt: skip
    # pack the queries (TND) and page the keys through a shuffled block table
    q_t = torch.cat([q[0, :3], q[1, :2]])
    w_t = torch.cat([w[0, :3], w[1, :2]])
    block_size, num_blocks = 4, 9
    table = torch.tensor([[7, 2, 5], [0, 8, 3]], dtype=I32)
    cache = torch.randn(num_blocks, block_size, 1, 8)
    for b in range(2):
        for t in range(kv_lens[b]):
            cache[table[b, t // block_size], t % block_size] = k[b, t]
    got, _ = npu.npu_lightning_indexer(
        q_t, cache, w_t,
        actual_seq_lengths_query=torch.tensor([3, 5], dtype=I32),
        actual_seq_lengths_key=torch.tensor(kv_lens, dtype=I32), block_table=table,
        layout_query="TND", layout_key="PA_BSND", sparse_count=5,
    )  # fmt: skip
    assert got.shape == (5, 1, 5)
    assert torch.equal(got[:3], ref[0, :3]) and torch.equal(got[3:], ref[1, :2])


def test_return_value_gives_the_scores_of_the_chosen_positions():
    q, k, w = make(4, b=1, s1=2, s2=6)
    idx, values = npu.npu_lightning_indexer(q, k, w, sparse_count=8, return_value=True)
    assert values.shape == idx.shape and values.dtype == q.dtype
    scores = (torch.relu(torch.einsum("hd,td->ht", q[0, 1], k[0, :, 0])) * w[0, 1].view(-1, 1)).sum(
        0
    )
    row, vals = idx[0, 1, 0], values[0, 1, 0]
    assert torch.allclose(vals[:6], scores[row[:6].long()])
    assert bool(torch.isinf(vals[6:]).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparse_mode": 1}, "sparse_mode must be 0"),
        ({"sparse_count": 2049}, "sparse_count must be in 1..2048"),
        ({"sparse_count": 0}, "sparse_count"),
        ({"layout_key": "PA_BSND"}, "requires block_table"),
        ({"layout_key": "TND"}, "must equal layout_query"),
        ({"pre_tokens": 5}, "pre_tokens/next_tokens"),
        ({"layout_query": "BNSD"}, "layout_query must be one of"),
    ],
)
def test_documented_limits_raise(kwargs, message):
    q, k, w = make(5, b=1)
    with pytest.raises(OpInputError, match=message):
        npu.npu_lightning_indexer(q, k, w, **kwargs)


def test_sparse_count_accepts_the_listed_large_values():
    q, k, w = make(6, b=1, s1=1, s2=3)
    idx, _ = npu.npu_lightning_indexer(q, k, w, sparse_count=3072, sparse_mode=0)
    assert idx.shape[-1] == 3072 and idx[0, 0, 0, 3:].eq(-1).all()


def test_more_than_one_key_head_and_mixed_dtypes_raise():
    q, k, w = make(7, b=1)
    with pytest.raises(OpInputError, match="must have 1 head"):
        npu.npu_lightning_indexer(q, k.expand(-1, -1, 2, -1).contiguous(), w)
    with pytest.raises(OpInputError, match="share one dtype"):
        npu.npu_lightning_indexer(q, k.half(), w)


def test_lengths_are_tensors_and_keywords_are_the_indexers():
    q, k, w = make(8, b=1)
    with pytest.raises(TypeError, match="int32 tensor"):
        npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_query=[5])
    with pytest.raises(TypeError, match="actual_seq_lengths_key"):
        npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_kv=torch.tensor([9], dtype=I32))


def test_npu_profile_enforces_head_dim_block_size_and_dtypes():
    q, k, w = make(9, b=1)
    with npu_limits(), pytest.raises(OpInputError, match="head dim 128"):
        npu.npu_lightning_indexer(q.bfloat16(), k.bfloat16(), w.bfloat16())
    q, k, w = make(9, b=1, d=128)
    with npu_limits(), pytest.raises(OpInputError, match="float16, bfloat16"):
        npu.npu_lightning_indexer(q, k, w)
    table = torch.tensor([[0, 1]], dtype=I32)
    cache = torch.randn(2, 8, 1, 128, dtype=torch.bfloat16)
    with npu_limits(), pytest.raises(OpInputError, match="multiple of 16"):
        npu.npu_lightning_indexer(
            q.bfloat16(), cache, w.bfloat16(), block_table=table, layout_key="PA_BSND",
            actual_seq_lengths_key=torch.tensor([9], dtype=I32),
        )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    q_len=st.integers(1, 5),
    extra=st.integers(0, 6),
    sparse_count=st.integers(1, 12),
    sparse_mode=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
def test_every_row_holds_the_best_visible_positions_then_minus_one(
    q_len, extra, sparse_count, sparse_mode, seed
):
    kv_len = q_len + extra
    q, k, w = make(seed, b=1, s1=q_len, s2=kv_len, n1=2, d=4)
    idx, values = npu.npu_lightning_indexer(
        q, k, w, sparse_count=sparse_count, sparse_mode=sparse_mode, return_value=True
    )
    for i in range(q_len):
        visible = kv_len if sparse_mode == 0 else extra + i + 1
        row, vals = idx[0, i, 0].tolist(), values[0, i, 0]
        kept = min(sparse_count, visible)
        assert row[kept:] == [-1] * (sparse_count - kept)
        assert len(set(row[:kept])) == kept and all(0 <= j < visible for j in row[:kept])
        assert all(vals[a] >= vals[a + 1] for a in range(kept - 1))  # best first
        if kept < visible:  # every dropped visible position scores no higher than the kept
            scores = (torch.relu(k[0, :visible, 0] @ q[0, i].T) * w[0, i]).sum(-1)
            dropped = [j for j in range(visible) if j not in row[:kept]]
            assert float(scores[dropped].max()) <= float(vals[kept - 1]) + 1e-6
