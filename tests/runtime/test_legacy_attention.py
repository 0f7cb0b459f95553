"""Legacy attention inputs: padded queries, each request's static row and the mask its
positions need, checked against attention computed request by request."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime import (
    ForwardMetaData,
    legacy_attention_inputs,
    packed_output,
    step_metadata,
)

HEADS, KV_HEADS, DIM, ROW = 4, 2, 8, 32


def _metadata(q_lens: list[int], kv_lens: list[int], rows: list[int]) -> ForwardMetaData:
    return step_metadata(
        is_prefill=max(q_lens) > 1,
        q_lens=q_lens,
        kv_lens=kv_lens,
        block_table={"Legacy": torch.tensor(rows, dtype=torch.int32).view(-1, 1)},
        slot_mapping={},
        attention_mask=None,
        device="cpu",
    )


def _eager(query, key, value, mask):
    """transformers' eager attention: scores + additive mask, softmax, weighted values."""
    key = key.repeat_interleave(HEADS // KV_HEADS, dim=1)
    value = value.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = query @ key.transpose(-1, -2) * DIM**-0.5 + mask
    return (scores.softmax(-1) @ value).transpose(1, 2)  # [B, L, N, D]


def _one_request(q, k, v, start: int, window: int | None, chunk: int | None):
    """Attention of one request's queries q [L, N, D] at positions start.. over k/v [C, Nkv, D]."""
    out = []
    for t in range(q.size(0)):
        p = start + t
        keys = [
            j
            for j in range(p + 1)
            if (window is None or j > p - window) and (chunk is None or j // chunk == p // chunk)
        ]
        kk = k[keys].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [n, N, D]
        vv = v[keys].repeat_interleave(HEADS // KV_HEADS, dim=1)
        w = torch.einsum("nd,knd->nk", q[t], kk) * DIM**-0.5
        out.append(torch.einsum("nk,knd->nd", w.softmax(-1), vv))
    return torch.stack(out)


@pytest.mark.parametrize(("window", "chunk"), [(None, None), (3, None), (None, 4)])
def test_mixed_prefill_and_decode_rows_match_attention_per_request(window, chunk):
    torch.manual_seed(0)
    q_lens, kv_lens, rows = [5, 1, 3], [5, 9, 11], [2, 0, 3]
    k_cache = torch.randn(4, ROW, KV_HEADS, DIM, dtype=torch.float64)
    v_cache = torch.randn(4, ROW, KV_HEADS, DIM, dtype=torch.float64)
    query = torch.randn(sum(q_lens), HEADS, DIM, dtype=torch.float64)
    md = _metadata(q_lens, kv_lens, rows)
    q, k, v, mask = legacy_attention_inputs(
        query, k_cache, v_cache, md, "Legacy", window=window, chunk=chunk
    )
    assert q.shape == (3, HEADS, 5, DIM) and k.shape == (3, KV_HEADS, 11, DIM)
    assert mask.shape == (3, 1, 5, 11) and mask.dtype == torch.float64
    got = packed_output(_eager(q, k, v, mask), md)
    assert got.shape == (1, sum(q_lens), HEADS, DIM)
    start = 0
    for b, (n, ctx, row) in enumerate(zip(q_lens, kv_lens, rows, strict=True)):
        want = _one_request(
            query[start : start + n], k_cache[row], v_cache[row], ctx - n, window, chunk
        )
        torch.testing.assert_close(got[0, start : start + n], want, msg=f"request {b}")
        start += n


def test_keys_past_a_request_s_context_are_never_visible():
    md = _metadata([2, 1], [2, 6], [1, 0])
    cache = torch.zeros(2, ROW, KV_HEADS, DIM)
    _, _, _, mask = legacy_attention_inputs(torch.zeros(3, HEADS, DIM), cache, cache, md, "Legacy")
    visible = mask[:, 0] == 0
    # request 0: positions 0 and 1 over a 2-token row; the padded context (keys 2..5) is hidden
    assert visible[0, :, :2].tolist() == [[True, False], [True, True]]
    assert not visible[0, :, 2:].any()
    # request 1 decodes its sixth token: every key up to it; its padding query row sees none
    assert visible[1, 0].all() and not visible[1, 1].any()
