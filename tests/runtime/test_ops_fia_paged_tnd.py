"""FA v1/v2 on the path converted models use: TND query, paged 3-D KV, sparse modes 0/3/4."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from ops_golden import (
    CAUSAL_TILE,
    INT_MAX,
    make_paged_case,
    naive_batch,
    paged_fia_v1,
    rule_for,
    tolerance,
)

# (q_lens, kv_lens): prefill (q = kv), decode (q = 1), chunked prefill (q < kv), mixed.
SHAPES = {
    "prefill": ([5, 9, 3], [5, 9, 3]),
    "decode": ([1, 1, 1, 1], [7, 1, 12, 4]),
    "chunked": ([3, 4], [10, 6]),
    "mixed": ([1, 6, 1], [9, 6, 3]),
}
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}


def _call_v1(case, n, kvn, scale, mode, pre=INT_MAX, nxt=INT_MAX, lse=False):
    return paged_fia_v1(
        case, num_heads=n, num_kv_heads=kvn, scale=scale, mode=mode, pre=pre, nxt=nxt, lse=lse
    )


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mode", [0, 3])
def test_v1_tnd_paged_matches_naive(shape, heads, mode):
    q_lens, kv_lens = SHAPES[shape]
    n, kvn = HEADS[heads]
    case = make_paged_case(
        q_lens, kv_lens, num_heads=n, num_kv_heads=kvn, head_dim=8, block_size=4, seed=1
    )
    out, lse = _call_v1(case, n, kvn, 0.37, mode, lse=True)
    want_out, want_lse = naive_batch(case, 0.37, rule_for(mode))
    assert out.shape == (sum(q_lens), n, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
    assert lse.shape == (sum(q_lens), n, 1)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[..., 0].double()[finite], want_lse[finite], atol=2e-5, rtol=0)


# Windows shorter than the sequences (rows see a band) and longer (band = causal).
@pytest.mark.parametrize("pre,nxt", [(0, 0), (2, 0), (3, 1), (50, 0)])
@pytest.mark.parametrize("shape", ["prefill", "decode", "chunked"])
def test_v1_band_mode4_is_bottom_right_aligned(pre, nxt, shape):
    q_lens, kv_lens = SHAPES[shape]
    case = make_paged_case(
        q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=2
    )
    out, _ = _call_v1(case, 4, 2, 0.5, 4, pre, nxt)
    want, _ = naive_batch(case, 0.5, rule_for(4, pre, nxt))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_window_of_w_tokens_including_current_needs_pre_tokens_w_minus_1():
    # A decode row at position p with pre_tokens=W-1, next_tokens=0 sees exactly W keys:
    # make all values 0 except the key just outside the window; the output must stay 0.
    w, kv = 3, 8
    case = make_paged_case([1], [kv], num_heads=1, num_kv_heads=1, head_dim=4, block_size=4)
    case.vs[0].zero_()
    case.vs[0][kv - w - 1] = 1.0
    for t in range(kv):
        blk = int(case.block_table[0, t // 4])
        case.value_cache[blk, t % 4] = case.vs[0][t]
    out, _ = _call_v1(case, 1, 1, 1.0, 4, pre=w - 1, nxt=0)
    assert torch.count_nonzero(out) == 0
    out_wider, _ = _call_v1(case, 1, 1, 1.0, 4, pre=w, nxt=0)
    assert torch.count_nonzero(out_wider) > 0


@pytest.mark.parametrize("mode,pre,nxt", [(3, INT_MAX, INT_MAX), (4, 2, 0), (0, INT_MAX, INT_MAX)])
def test_v2_matches_v1(mode, pre, nxt):
    case = make_paged_case(
        [2, 5], [6, 5], num_heads=4, num_kv_heads=1, head_dim=8, block_size=2, seed=3
    )
    nb, bs = case.key_cache.shape[:2]
    out2, lse2 = npu.npu_fused_infer_attention_score_v2(
        case.query_tnd,
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_query_heads=4,
        num_key_value_heads=1,
        input_layout="TND",
        softmax_scale=0.25,
        atten_mask=CAUSAL_TILE if mode else None,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=nxt,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_qlen=case.cu_q,
        actual_seq_kvlen=case.kv_lens,
        return_softmax_lse=True,
    )
    want, _ = naive_batch(case, 0.25, rule_for(mode, pre, nxt))
    torch.testing.assert_close(out2.double(), want, atol=2e-5, rtol=2e-5)
    out1, lse1 = _call_v1(case, 4, 1, 0.25, mode, pre, nxt, lse=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_keep_their_dtype(dtype):
    case = make_paged_case(
        [3, 1], [5, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype
    )
    out, lse = _call_v1(case, 4, 2, 0.25, 3)
    assert out.dtype == dtype
    assert lse.shape == (0,) and lse.dtype == torch.float32
    want, _ = naive_batch(case, 0.25, rule_for(3))
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))


def test_scale_defaults_to_one_not_inverse_sqrt_d():
    case = make_paged_case([2], [4], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4)
    nb, bs = case.key_cache.shape[:2]
    out, _ = npu.npu_fused_infer_attention_score(
        case.query_tnd,
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_heads=2,
        input_layout="TND",
        block_table=case.block_table,
        block_size=bs,
        actual_seq_lengths=case.cu_q,
        actual_seq_lengths_kv=case.kv_lens,
    )
    want, _ = naive_batch(case, 1.0, rule_for(0))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_scatter_nd_update_writes_slots_then_fa_reads_them():
    # The converted-model sequence: write K/V at slot_mapping, then attend through block_table.
    n, kvn, d, bs = 4, 2, 8, 4
    torch.manual_seed(0)
    k_cache = torch.zeros(6, bs, kvn, d)
    v_cache = torch.zeros(6, bs, kvn, d)
    block_table = torch.tensor([[4, 2], [5, 1]], dtype=torch.int32)
    lens = [6, 3]
    slots = torch.cat(
        [
            block_table[b, torch.arange(s) // bs].long() * bs + torch.arange(s) % bs
            for b, s in enumerate(lens)
        ]
    )
    q = torch.randn(sum(lens), n, d)
    k = torch.randn(sum(lens), kvn, d)
    v = torch.randn(sum(lens), kvn, d)
    ret = npu.npu_scatter_nd_update_(k_cache.view(-1, kvn, d), slots.view(-1, 1), k)
    npu.npu_scatter_nd_update_(v_cache.view(-1, kvn, d), slots.view(-1, 1), v)
    assert ret.data_ptr() == k_cache.data_ptr()
    assert torch.equal(k_cache[4, 1], k[1]) and torch.equal(k_cache[5, 2], k[8])
    out, _ = npu.npu_fused_infer_attention_score(
        q,
        k_cache.view(6, bs, -1),
        v_cache.view(6, bs, -1),
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        scale=0.3,
        atten_mask=CAUSAL_TILE,
        sparse_mode=3,
        block_table=block_table,
        block_size=bs,
        actual_seq_lengths=[6, 9],
        actual_seq_lengths_kv=lens,
    )
    # Dense causal attention per request with PyTorch SDPA as an independent cross-check.
    starts = [0, 6]
    for b, s in enumerate(lens):
        qb = q[starts[b] : starts[b] + s].transpose(0, 1)
        kb = k[starts[b] : starts[b] + s].repeat_interleave(2, dim=1).transpose(0, 1)
        vb = v[starts[b] : starts[b] + s].repeat_interleave(2, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=0.3
        ).transpose(0, 1)
        torch.testing.assert_close(out[starts[b] : starts[b] + s], want, atol=1e-5, rtol=1e-5)


def test_unknown_keyword_names_the_right_one_for_each_version():
    case = make_paged_case([1], [2], num_heads=1, num_kv_heads=1, head_dim=4, block_size=2)
    args = (case.query_tnd, case.key_cache.view(-1, 2, 4), case.value_cache.view(-1, 2, 4))
    with pytest.raises(TypeError, match="v1 takes `scale`"):
        npu.npu_fused_infer_attention_score(*args, softmax_scale=0.5)
    with pytest.raises(TypeError, match="v1 takes `actual_seq_lengths_kv`"):
        npu.npu_fused_infer_attention_score(*args, actual_seq_kvlen=[2])
    with pytest.raises(TypeError, match="v2 takes `softmax_scale`"):
        npu.npu_fused_infer_attention_score_v2(*args, scale=0.5)
    with pytest.raises(TypeError, match="v2 takes `num_query_heads`"):
        npu.npu_fused_infer_attention_score_v2(*args, num_heads=1)
    with pytest.raises(TypeError, match="learnable_sink exists only in"):
        npu.npu_fused_infer_attention_score(*args, learnable_sink=torch.zeros(1))
    with pytest.raises(TypeError):
        npu.npu_fused_infer_attention_score(*args, 1)  # keyword-only beyond value


def test_works_inside_and_outside_inference_mode_in_any_order():
    case = make_paged_case([2], [6], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4)
    with torch.inference_mode():
        inside, _ = _call_v1(case, 2, 2, 0.3, 3)
    outside, _ = _call_v1(case, 2, 2, 0.3, 3)
    with torch.inference_mode():
        again, _ = _call_v1(case, 2, 2, 0.3, 3)
    assert torch.equal(inside, outside) and torch.equal(outside, again)


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("lens", [[7], [5, 5]])
def test_full_causal_prefill_of_equal_requests(mode, lens):
    # Equal-length prompts without cache (q == kv) take the kernel's causal path (mode 3);
    # packed prefill does not take mode 2 (npu_ops.md §9).
    case = make_paged_case(
        lens, lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=5
    )
    if mode == 2:
        with pytest.raises(npu.OpInputError, match="takes sparse_mode 0 without a mask or 3/4"):
            _call_v1(case, 4, 2, 0.3, mode)
        return
    out, _ = _call_v1(case, 4, 2, 0.3, mode)
    want, _ = naive_batch(case, 0.3, rule_for(mode))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_mask_built_under_inference_mode_is_accepted_and_checked():
    case = make_paged_case([3], [5], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4)
    nb, bs = case.key_cache.shape[:2]
    with torch.inference_mode():
        tile = torch.ones(2048, 2048, dtype=torch.bool).triu(diagonal=1)
        wrong = torch.zeros(2048, 2048, dtype=torch.bool)
    for mask, ok in ((tile, True), (tile, True), (wrong, False)):
        call = lambda m=mask: npu.npu_fused_infer_attention_score(  # noqa: E731
            case.query_tnd,
            case.key_cache.view(nb, bs, -1),
            case.value_cache.view(nb, bs, -1),
            num_heads=2,
            input_layout="TND",
            scale=0.3,
            atten_mask=m,
            sparse_mode=3,
            block_table=case.block_table,
            block_size=bs,
            actual_seq_lengths=case.cu_q,
            actual_seq_lengths_kv=case.kv_lens,
        )
        if ok:
            out, _ = call()
            want, _ = naive_batch(case, 0.3, rule_for(3))
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        else:
            with pytest.raises(RuntimeError, match="must be triu"):
                call()
