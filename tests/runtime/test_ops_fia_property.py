"""Property test: random paged TND calls (lengths, modes, windows, heads) agree with naive math."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvskill.runtime.ops import reference as npu
from ops_golden import CAUSAL_TILE, make_paged_case, naive_batch, rule_for


@st.composite
def calls(draw):
    batch = draw(st.integers(1, 3))
    kv_lens = [draw(st.integers(1, 11)) for _ in range(batch)]
    q_lens = [draw(st.integers(1, kv)) for kv in kv_lens]
    kvn = draw(st.sampled_from([1, 2]))
    n = kvn * draw(st.sampled_from([1, 2, 3]))
    mode = draw(st.sampled_from([0, 3, 4]))
    pre = draw(st.integers(0, 12))
    nxt = draw(st.integers(0, 2))
    lse = draw(st.booleans())
    block_size = draw(st.sampled_from([1, 2, 4]))
    return q_lens, kv_lens, n, kvn, mode, pre, nxt, lse, block_size, draw(st.integers(0, 99))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_random_paged_tnd_calls_match_naive(args):
    q_lens, kv_lens, n, kvn, mode, pre, nxt, lse, block_size, seed = args
    case = make_paged_case(
        q_lens, kv_lens, num_heads=n, num_kv_heads=kvn, head_dim=4, block_size=block_size, seed=seed
    )
    nb = case.key_cache.shape[0]
    out, _ = npu.npu_fused_infer_attention_score(
        case.query_tnd,
        case.key_cache.view(nb, block_size, -1),
        case.value_cache.view(nb, block_size, -1),
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        scale=0.5,
        atten_mask=CAUSAL_TILE if mode else None,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=nxt,
        block_table=case.block_table,
        block_size=block_size,
        actual_seq_lengths=case.cu_q,
        actual_seq_lengths_kv=kv_lens,
        softmax_lse_flag=lse,
    )
    want, _ = naive_batch(case, 0.5, rule_for(mode, pre, nxt))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
