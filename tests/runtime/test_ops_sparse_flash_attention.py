"""npu_sparse_flash_attention against naive loops: selection, causality, blocks, paging, limits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import OpInputError, ReferenceUnsupportedError
from kvskill.runtime.ops.reference.npu_profile import npu_limits

I32 = torch.int32
D, DR = 16, 4  # latent and rope dims at toy size (the NPU takes 512 and 64: profile `dims`)


def naive_row(q, qr, k, kr, entries, q_len, kv_len, i, sparse_mode, sbs, scale):
    """One query row, all its heads: q [N1, D], k [S2, D] (latent = value) -> ([N1, D], max, sum)."""
    limit = kv_len if sparse_mode == 0 else kv_len - q_len + i + 1
    positions = []
    for e in entries[: max(0, math.ceil(limit / sbs))]:
        if e == -1:
            break
        for p in range(e * sbs, e * sbs + sbs):
            if p < limit and p < kv_len:
                positions.append(p)
    out = torch.zeros(q.size(0), k.size(1), dtype=torch.float64)
    row_max = torch.zeros(q.size(0), dtype=torch.float64)
    row_sum = torch.zeros(q.size(0), dtype=torch.float64)
    if sparse_mode == 3 and i < q_len - kv_len:
        return out, row_max, row_sum
    for h in range(q.size(0)):
        if not positions:
            continue
        s = [
            scale * (float(q[h].double() @ k[p].double()) + float(qr[h].double() @ kr[p].double()))
            for p in positions
        ]
        m = max(s)
        e = [math.exp(x - m) for x in s]
        total = sum(e)
        for weight, p in zip(e, positions, strict=True):
            out[h] += weight / total * k[p].double()
        row_max[h], row_sum[h] = m, total
    return out, row_max, row_sum


def make(seed, b=2, s1=4, s2=12, n1=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s1, n1, D, generator=g)
    qr = torch.randn(b, s1, n1, DR, generator=g)
    k = torch.randn(b, s2, 1, D, generator=g)
    kr = torch.randn(b, s2, 1, DR, generator=g)
    return q, qr, k, kr


def random_indices(seed, b, s1, count, num_entries, valid):
    """[B, S1, 1, count]: `valid[b]` distinct entries below num_entries[b] in front, -1 after."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((b, s1, 1, count), -1, dtype=I32)
    for bi in range(b):
        for i in range(s1):
            perm = torch.randperm(num_entries[bi], generator=g)[: valid[bi]]
            idx[bi, i, 0, : perm.numel()] = perm.to(I32)
    return idx


def run(q, qr, k, kr, idx, scale, **kwargs):
    kwargs.setdefault("attention_mode", 2)
    return npu.npu_sparse_flash_attention(q, k, k, idx, scale, query_rope=qr, key_rope=kr, **kwargs)


@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("sbs", [1, 2, 4])
def test_bsnd_matches_the_naive_loops(sparse_mode, sbs):
    q, qr, k, kr = make(0)
    q_lens, kv_lens = [4, 3], [12, 7]
    blocks = [math.ceil(n / sbs) for n in kv_lens]
    idx = random_indices(1, 2, 4, count=5, num_entries=blocks, valid=[min(5, x) for x in blocks])
    out, mx, sm = run(
        q, qr, k, kr, idx, 0.3, sparse_block_size=sbs, sparse_mode=sparse_mode,
        actual_seq_lengths_query=torch.tensor(q_lens, dtype=I32),
        actual_seq_lengths_kv=torch.tensor(kv_lens, dtype=I32), return_softmax_lse=True,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    assert mx.shape == sm.shape == (2, 1, 4, 4)
    for b in range(2):
        for i in range(q_lens[b]):
            want, w_max, w_sum = naive_row(
                q[b, i], qr[b, i], k[b, :, 0], kr[b, :, 0], idx[b, i, 0].tolist(),
                q_lens[b], kv_lens[b], i, sparse_mode, sbs, 0.3,
            )  # fmt: skip
            assert torch.allclose(out[b, i].double(), want, atol=1e-5), (b, i)
            assert torch.allclose(mx[b, 0, i].double(), w_max, atol=1e-5)
            assert torch.allclose(sm[b, 0, i].double(), w_sum, atol=1e-5)
    assert bool((out[1, 3] == 0).all())  # padded query row


def test_rows_before_the_causal_start_and_empty_selections_are_zero():
    # q_len 3 > kv_len 2 in mode 3: row 0 sees no key at all
    q, qr, k, kr = make(2, b=1, s1=3, s2=2)
    idx = torch.tensor([[[[0, 1]], [[0, -1]], [[1, 0]]]], dtype=I32)
    out, _, _ = run(q, qr, k, kr, idx, 1.0, sparse_mode=3)
    assert bool((out[0, 0] == 0).all())
    want, _, _ = naive_row(q[0, 1], qr[0, 1], k[0, :, 0], kr[0, :, 0], [0, -1], 3, 2, 1, 3, 1, 1.0)
    assert torch.allclose(out[0, 1].double(), want, atol=1e-5)
    # an all -1 row chooses nothing
    idx = torch.full((1, 3, 1, 2), -1, dtype=I32)
    out, _, _ = run(q, qr, k, kr, idx, 1.0, sparse_mode=0)
    assert bool((out == 0).all())


def test_paged_tnd_with_a_shuffled_block_table_matches_bsnd():
    q, qr, k, kr = make(3, b=2, s1=3, s2=11)
    q_lens, kv_lens = [3, 2], [11, 6]
    idx = random_indices(4, 2, 3, count=4, num_entries=kv_lens, valid=[4, 4])
    ref, _, _ = run(
        q, qr, k, kr, idx, 0.5,
        actual_seq_lengths_query=torch.tensor(q_lens, dtype=I32),
        actual_seq_lengths_kv=torch.tensor(kv_lens, dtype=I32),
    )  # fmt: skip
    block_size, num_blocks = 4, 8
    table = torch.tensor([[6, 1, 4], [3, 7, 0]], dtype=I32)
    cache = torch.randn(num_blocks, block_size, 1, D)
    rope_cache = torch.randn(num_blocks, block_size, 1, DR)
    for b in range(2):
        for t in range(kv_lens[b]):
            cache[table[b, t // block_size], t % block_size] = k[b, t]
            rope_cache[table[b, t // block_size], t % block_size] = kr[b, t]
    pack = lambda x: torch.cat([x[0, :3], x[1, :2]])  # noqa: E731
    got, _, _ = npu.npu_sparse_flash_attention(
        pack(q), cache, cache, pack(idx), 0.5, query_rope=pack(qr), key_rope=rope_cache,
        block_table=table, actual_seq_lengths_query=torch.tensor([3, 5], dtype=I32),
        actual_seq_lengths_kv=torch.tensor(kv_lens, dtype=I32),
        layout_query="TND", layout_kv="PA_BSND", attention_mode=2,
    )  # fmt: skip
    assert got.shape == (5, 4, D)
    assert torch.allclose(got[:3], ref[0, :3], atol=1e-6)
    assert torch.allclose(got[3:], ref[1, :2], atol=1e-6)


def test_the_indexers_selection_matters():
    # a long sequence, the indexer keeps 3 of 16 positions per row: attending to them differs
    # from attending to every position, which equals the dense causal softmax
    g = torch.Generator().manual_seed(5)
    s, n1 = 16, 4
    q, qr, k, kr = make(6, b=1, s1=s, s2=s, n1=n1)
    iq, ik, iw = (
        torch.randn(1, s, 2, 8, generator=g),
        torch.randn(1, s, 1, 8, generator=g),
        torch.randn(1, s, 2, generator=g),
    )
    top, _ = npu.npu_lightning_indexer(iq, ik, iw, sparse_count=3, sparse_mode=3)
    sparse, _, _ = run(q, qr, k, kr, top, 0.25, sparse_mode=3)
    every = torch.arange(s, dtype=I32).view(1, 1, 1, s).expand(1, s, 1, s)
    every = torch.where(every <= torch.arange(s).view(1, s, 1, 1), every, -1).contiguous()
    full, _, _ = run(q, qr, k, kr, every, 0.25, sparse_mode=3)
    logits = torch.einsum("shd,td->hst", q[0], k[0, :, 0]) + torch.einsum(
        "shd,td->hst", qr[0], kr[0, :, 0]
    )
    logits = (0.25 * logits).masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    dense = torch.einsum("hst,td->shd", logits.softmax(-1), k[0, :, 0])
    assert torch.allclose(full[0], dense, atol=1e-5)
    # rows 0..2 see at most 3 keys, so the selection keeps all of them there
    assert torch.allclose(sparse[0, :3], full[0, :3], atol=1e-6)
    assert (sparse[0, 3:] - full[0, 3:]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparse_mode": 2}, "sparse_mode must be 0"),
        ({"attention_mode": 0}, "attention_mode must be 2"),
        ({"sparse_block_size": 3}, "power of two"),
        ({"sparse_block_size": 256}, "power of two"),
        ({"layout_kv": "PA_BSND"}, "requires block_table"),
        ({"next_tokens": 0}, "pre_tokens/next_tokens"),
    ],
)
def test_documented_limits_raise(kwargs, message):
    q, qr, k, kr = make(7, b=1)
    idx = torch.zeros(1, 4, 1, 2, dtype=I32)
    with pytest.raises(OpInputError, match=message):
        run(q, qr, k, kr, idx, 1.0, **kwargs)


def test_a_valid_index_after_minus_one_raises():
    q, qr, k, kr = make(8, b=1)
    idx = torch.tensor([[[[0, -1, 2]]] * 4], dtype=I32)
    with pytest.raises(OpInputError, match="valid position after a -1"):
        run(q, qr, k, kr, idx, 1.0)


def test_missing_rope_dense_mask_and_unmodelled_arguments():
    q, qr, k, kr = make(9, b=1)
    idx = torch.zeros(1, 4, 1, 2, dtype=I32)
    with pytest.raises(OpInputError, match="query_rope and key_rope are required"):
        npu.npu_sparse_flash_attention(q, k, k, idx, 1.0, attention_mode=2)
    with pytest.raises(TypeError, match="takes no dense mask"):
        npu.npu_sparse_flash_attention(q, k, k, idx, 1.0, atten_mask=torch.ones(4, 12).bool())
    with pytest.raises(ReferenceUnsupportedError, match="Ascend 950"):
        run(q, qr, k, kr, idx, 1.0, sinks=torch.zeros(4))
    with pytest.raises(ReferenceUnsupportedError, match="value=None"):
        npu.npu_sparse_flash_attention(
            q, k, None, idx, 1.0, query_rope=qr, key_rope=kr, attention_mode=2
        )


def test_paged_sparse_block_size_must_divide_the_block_size():
    q, qr, k, kr = make(10, b=1, s1=1)
    cache, rope = torch.randn(4, 4, 1, D), torch.randn(4, 4, 1, DR)
    with pytest.raises(OpInputError, match="must divide the paged block_size 4"):
        npu.npu_sparse_flash_attention(
            q, cache, cache, torch.zeros(1, 1, 1, 2, dtype=I32), 1.0, query_rope=qr,
            key_rope=rope, block_table=torch.tensor([[0, 1]], dtype=I32),
            actual_seq_lengths_kv=torch.tensor([8], dtype=I32), layout_kv="PA_BSND",
            sparse_block_size=8, attention_mode=2,
        )  # fmt: skip


def test_npu_profile_enforces_latent_dims_and_dtypes():
    q, qr, k, kr = make(11, b=1)
    idx = torch.zeros(1, 4, 1, 2, dtype=I32)
    with npu_limits(), pytest.raises(OpInputError, match="float16, bfloat16"):
        run(q, qr, k, kr, idx, 1.0)
    half = [x.bfloat16() for x in (q, qr, k, kr)]
    with npu_limits(), pytest.raises(OpInputError, match="head dim must be 512"):
        run(*half, idx, 1.0)


@settings(max_examples=30, deadline=None)
@given(
    sbs=st.sampled_from([2, 4]),
    kv_len=st.integers(1, 14),
    q_len=st.integers(1, 4),
    sparse_mode=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
def test_a_block_entry_equals_its_tokens_listed_one_by_one(sbs, kv_len, q_len, sparse_mode, seed):
    # block e of sbs tokens is positions e*sbs .. e*sbs + sbs - 1: listing them token-wise
    # (sparse_block_size 1) must give the same attention, causal clipping included
    q, qr, k, kr = make(seed, b=1, s1=q_len, s2=kv_len, n1=2)
    num_blocks = math.ceil(kv_len / sbs)
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g)[: max(1, num_blocks // 2)]
    tokens = [int(b) * sbs + j for b in blocks for j in range(sbs) if int(b) * sbs + j < kv_len]
    # as the indexer writes them: each row's visible entries first (only the first
    # ceil(limit / sparse_block_size) entries of a row are read), -1 after
    by_block = _visible_first([int(b) for b in blocks], q_len, kv_len, sparse_mode, sbs)
    by_token = _visible_first(tokens, q_len, kv_len, sparse_mode, 1)
    kwargs = {
        "sparse_mode": sparse_mode,
        "actual_seq_lengths_kv": torch.tensor([kv_len], dtype=I32),
    }
    a, _, _ = run(q, qr, k, kr, by_block, 0.5, sparse_block_size=sbs, **kwargs)
    b, _, _ = run(q, qr, k, kr, by_token, 0.5, **kwargs)
    assert torch.allclose(a, b, atol=1e-5)


def _visible_first(entries, q_len, kv_len, sparse_mode, sbs):
    """[1, q_len, 1, len(entries)]: per row the entries whose first token is visible, -1 after."""
    out = torch.full((1, q_len, 1, len(entries)), -1, dtype=I32)
    for i in range(q_len):
        limit = kv_len if sparse_mode == 0 else kv_len - q_len + i + 1
        visible = [e for e in entries if e * sbs < limit]
        out[0, i, 0, : len(visible)] = torch.tensor(visible, dtype=I32)
    return out
