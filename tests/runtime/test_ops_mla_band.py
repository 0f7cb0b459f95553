"""A sliding window (band, sparse_mode 4) on the absorbed MLA latent: FA v1's documented case
(约束说明 › query_rope和key_rope参数约束 › sparse为4时: BSND, ND cache, one key head), checked
against attention written out here; and the same call refused where the docs refuse it."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import npu_profile
from ops_golden import CAUSAL_TILE

LATENT, ROPE, HEADS, BLOCK = 512, 64, 4, 4


def _band_case(q_len: int, kv_lens: list[int], seed: int = 0):
    """Paged latent and rope caches ([blocks, block_size, dim], ND) in shuffled blocks, and a
    BSND query of Q_LEN tokens per request (the last Q_LEN positions of each)."""
    gen = torch.Generator().manual_seed(seed)
    per_request = -(-max(kv_lens) // BLOCK)
    num_blocks = 1 + per_request * len(kv_lens)
    latent = torch.randn(num_blocks, BLOCK, LATENT, generator=gen)
    rope = torch.randn(num_blocks, BLOCK, ROPE, generator=gen)
    table = (1 + torch.randperm(num_blocks - 1, generator=gen)).view(len(kv_lens), -1)
    query = torch.randn(len(kv_lens), q_len, HEADS, LATENT, generator=gen)
    query_rope = torch.randn(len(kv_lens), q_len, HEADS, ROPE, generator=gen)
    return latent, rope, table.to(torch.int32), query, query_rope


def _band_call(case, kv_lens, *, pre, layout="BSND", q_lengths=None):
    latent, rope, table, query, query_rope = case
    return npu.npu_fused_infer_attention_score(
        query, latent, latent, query_rope=query_rope, key_rope=rope,
        num_heads=HEADS, num_key_value_heads=1, input_layout=layout, scale=0.05,
        atten_mask=CAUSAL_TILE, sparse_mode=4, pre_tokens=pre, next_tokens=0,
        block_table=table, block_size=BLOCK,
        actual_seq_lengths=q_lengths or [query.shape[1]] * len(kv_lens),
        actual_seq_lengths_kv=kv_lens,
    )  # fmt: skip


def _expected(case, kv_lens, window):
    """Each query row i of request b (absolute position kv - q + i) sees the WINDOW positions
    ending at its own: scale * (q . latent + q_rope . rope) over them, softmax, mix of latents."""
    latent, rope, table, query, query_rope = case
    q_len = query.shape[1]
    out = torch.zeros(len(kv_lens), q_len, HEADS, LATENT)
    for b, kv in enumerate(kv_lens):
        positions = torch.arange(kv)
        blocks = table[b, positions // BLOCK].long()
        keys = latent[blocks, positions % BLOCK]  # [kv, latent]
        key_rope = rope[blocks, positions % BLOCK]
        for i in range(q_len):
            at = kv - q_len + i
            seen = (positions <= at) & (positions > at - window)
            scores = 0.05 * (query[b, i] @ keys[seen].T + query_rope[b, i] @ key_rope[seen].T)
            out[b, i] = scores.softmax(-1) @ keys[seen]
    return out


@pytest.mark.parametrize("q_len", [1, 3])
def test_band_on_the_absorbed_latent_sees_the_window_only(q_len):
    kv_lens, window = [11, 6], 4
    case = _band_case(q_len, kv_lens)
    out, _ = _band_call(case, kv_lens, pre=window - 1)
    assert torch.allclose(out, _expected(case, kv_lens, window), atol=1e-5)
    # a window of 4 is not the causal attention over all positions
    assert not torch.allclose(out, _expected(case, kv_lens, max(kv_lens)), atol=1e-3)


def test_band_on_the_latent_is_refused_where_the_docs_refuse_it():
    kv_lens = [9, 6]
    case = _band_case(1, kv_lens)
    latent, rope, table, query, query_rope = case
    packed = (query.reshape(-1, HEADS, LATENT), query_rope.reshape(-1, HEADS, ROPE))
    with pytest.raises(npu.OpInputError, match="sparse_mode=4 takes input_layout 'BSND' only"):
        _band_call((latent, rope, table, *packed), kv_lens, pre=3, layout="TND", q_lengths=[1, 2])
    nz = latent.view(latent.shape[0], 1, LATENT // 16, BLOCK, 16)
    with pytest.raises(npu.OpInputError, match="ND key/value cache, not the 5-D NZ one"):
        _band_call((nz, rope, table, query, query_rope), kv_lens, pre=3)
    # v2's docs keep one query token per request to sparse_mode 0 on the latent
    with pytest.raises(npu.OpInputError, match="MLA decode .* takes sparse_mode=0"):
        npu.npu_fused_infer_attention_score_v2(
            query.reshape(-1, HEADS, LATENT), latent, latent,
            query_rope=query_rope.reshape(-1, HEADS, ROPE), key_rope=rope,
            num_query_heads=HEADS, num_key_value_heads=1, input_layout="TND", softmax_scale=0.05,
            atten_mask=CAUSAL_TILE, sparse_mode=4, pre_tokens=3, next_tokens=0,
            block_table=table, block_size=BLOCK,
            actual_seq_qlen=[1, 2], actual_seq_kvlen=kv_lens,
        )  # fmt: skip
    # on the device: 128 query heads and blocks of 64 or 128 only
    with npu_profile.npu_limits(), pytest.raises(npu.OpInputError, match="takes num_heads 128"):
        _band_call(case, kv_lens, pre=3)
