"""FA sinks (v2), MLA rope split with caches written by npu_kv_rmsnorm_rope_cache, LSE merge."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from ops_golden import CAUSAL_TILE, make_paged_case, naive_request, paged_fia_v1, rule_for


@pytest.mark.parametrize("mode,pre", [(3, 2147483647), (4, 3)])
def test_learnable_sink_adds_a_valueless_logit_per_head(mode, pre):
    n, kvn, d = 4, 2, 64
    case = make_paged_case(
        [3, 1], [5, 9], num_heads=n, num_kv_heads=kvn, head_dim=d, block_size=4, seed=21
    )
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    nb, bs = case.key_cache.shape[:2]
    out, lse = npu.npu_fused_infer_attention_score_v2(
        case.query_tnd,
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_query_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        softmax_scale=0.1,
        atten_mask=CAUSAL_TILE,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=0,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_qlen=case.cu_q,
        actual_seq_kvlen=case.kv_lens,
        learnable_sink=sink.to(torch.bfloat16),
        return_softmax_lse=True,
    )
    starts = [0, 3]
    for b in range(2):
        want, want_lse = naive_request(
            case.qs[b], case.ks[b], case.vs[b], 0.1, rule_for(mode, pre, 0), sink=sink
        )
        got = out[starts[b] : starts[b] + case.q_lens[b]]
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
        # unconfirmed on device: whether lse includes the sink; the reference includes it.
        got_lse = lse[starts[b] : starts[b] + case.q_lens[b], :, 0]
        torch.testing.assert_close(got_lse.double(), want_lse, atol=2e-5, rtol=2e-5)
    # The sink takes probability mass: output norms shrink compared with no sink.
    plain, _ = npu.npu_fused_infer_attention_score_v2(
        case.query_tnd,
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_query_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        softmax_scale=0.1,
        atten_mask=CAUSAL_TILE,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=0,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_qlen=case.cu_q,
        actual_seq_kvlen=case.kv_lens,
    )
    assert not torch.allclose(plain, out)


def test_lse_merges_two_partial_attentions_into_the_full_one():
    # Split one request's keys in two halves; merging with the returned lse must give the
    # attention over all keys (the documented use of softmax_lse).
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen) for _ in range(3))

    def attend(kk, vv):
        return npu.npu_fused_infer_attention_score(
            q, kk, vv, num_heads=2, input_layout="BSND", scale=0.4, softmax_lse_flag=True
        )

    full, _ = attend(k, v)
    o1, l1 = attend(k[:, :2], v[:, :2])
    o2, l2 = attend(k[:, 2:], v[:, 2:])
    l1 = l1[..., 0].transpose(1, 2).unsqueeze(-1)  # (B, N, S, 1) -> (B, S, N, 1)
    l2 = l2[..., 0].transpose(1, 2).unsqueeze(-1)
    m = torch.maximum(l1, l2)
    merged = (torch.exp(l1 - m) * o1 + torch.exp(l2 - m) * o2) / (
        torch.exp(l1 - m) + torch.exp(l2 - m)
    )
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


# --- MLA: caches written by npu_kv_rmsnorm_rope_cache, read back by FA ----------------------


def naive_rms_rope(kv, gamma, cos, sin, eps):
    """Independent RMSNorm (fp64) + interleaved-in, rotate-half-out rope, per token."""
    dc = gamma.numel()
    out_c, out_r = torch.empty(kv.shape[:-1] + (dc,)), torch.empty(kv.shape[:-1] + (64,))
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in kv.shape[:-1])):
        idx = tuple(idx.tolist())
        x = kv[idx].double()
        lat = x[:dc]
        out_c[idx] = (lat / torch.sqrt((lat**2).mean() + eps) * gamma.double()).float()
        r = x[dc:]
        c, s = cos[idx].double(), sin[idx].double()
        rot = torch.empty(64, dtype=torch.float64)
        for m in range(32):
            a, b = r[2 * m], r[2 * m + 1]
            rot[m] = a * c[m] - b * s[m]
            rot[m + 32] = b * c[m + 32] + a * s[m + 32]
        out_r[idx] = rot.float()
    return out_c, out_r


@pytest.mark.parametrize("nope", [128, 512])
def test_mla_nz_caches_written_then_read_by_fa(nope):
    torch.manual_seed(0)
    nb, bs, n, eps = 6, 16, 4, 1e-6
    lens = [20, 7]  # the first request spans two pages, the second a partial one
    table = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)
    kv = torch.randn(2, 1, 20, nope + 64)
    gamma = torch.rand(nope) + 0.5
    freq = torch.rand(20, 32) * 3
    cos = torch.cat((freq.cos(), freq.cos()), -1).expand(2, 1, 20, 64).contiguous()
    sin = torch.cat((freq.sin(), freq.sin()), -1).expand(2, 1, 20, 64).contiguous()
    pos = torch.arange(20)
    slots = table[:, pos // bs].long() * bs + pos % bs
    slots[1, 7:] = -1  # padding tokens of the short request are skipped
    k_cache = torch.zeros(nb, bs, 1, 64)
    ckv_cache = torch.zeros(nb, bs, 1, nope)
    ret = npu.npu_kv_rmsnorm_rope_cache(
        kv,
        gamma,
        cos,
        sin,
        slots.reshape(-1),
        k_cache,
        ckv_cache,
        epsilon=eps,
        cache_mode="PA_NZ",
        is_output_kv=True,
    )
    assert ret[0] is k_cache and ret[1] is ckv_cache
    want_c, want_r = naive_rms_rope(kv, gamma, cos, sin, eps)
    torch.testing.assert_close(ret[3], want_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret[2], want_r, atol=1e-5, rtol=1e-5)
    # Absorbed MLA decode/prefill: key = value = latent cache (NZ 5-D view), rope split.
    q_lens = [3, 2]
    q_nope = torch.randn(sum(q_lens), n, nope)
    q_rope = torch.randn(sum(q_lens), n, 64)
    out, _ = npu.npu_fused_infer_attention_score(
        q_nope,
        ckv_cache.view(nb, 1, nope // 16, bs, 16),
        ckv_cache.view(nb, 1, nope // 16, bs, 16),
        query_rope=q_rope,
        key_rope=k_cache.view(nb, 1, 4, bs, 16),
        num_heads=n,
        num_key_value_heads=1,
        input_layout="TND",
        scale=0.05,
        atten_mask=CAUSAL_TILE,
        sparse_mode=3,
        block_table=table,
        block_size=bs,
        actual_seq_lengths=[3, 5],
        actual_seq_lengths_kv=lens,
    )
    starts = [0, 3]
    for b in range(2):
        c = want_c[b, 0, : lens[b]].unsqueeze(1)
        r = want_r[b, 0, : lens[b]].unsqueeze(1)
        qs = slice(starts[b], starts[b] + q_lens[b])
        want, _ = naive_request(q_nope[qs], c, c, 0.05, rule_for(3), q_rope=q_rope[qs], k_rope=r)
        torch.testing.assert_close(out[qs].double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode,pre,nxt", [(3, 2147483647, 2147483647), (4, 1, 0), (0, 2, 0)])
def test_lse_and_no_lse_paths_agree_including_empty_rows(mode, pre, nxt):
    # softmax_lse_flag switches between two implementations of the same math; rows with no
    # admitted key (q longer than kv in mode 3) are zeros. Packed (TND) prefill takes mode 0
    # only without a mask, and then ignores pre/next (npu_ops.md §5).
    case = make_paged_case(
        [5, 1, 4], [3, 6, 4], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=31
    )
    mask = CAUSAL_TILE if mode else None
    outs = []
    for flag in (False, True):
        out, _ = paged_fia_v1(
            case,
            num_heads=4,
            num_kv_heads=2,
            scale=0.3,
            mode=mode,
            pre=pre,
            nxt=nxt,
            lse=flag,
            mask=mask,
        )
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    if mode == 3:
        assert torch.count_nonzero(outs[0][:2]) == 0  # rows 0, 1 of request 0 see no key
    rule = rule_for(0) if mode == 0 else rule_for(mode, pre, nxt)
    start = 0
    for b, s in enumerate(case.q_lens):
        want, _ = naive_request(case.qs[b], case.ks[b], case.vs[b], 0.3, rule)
        torch.testing.assert_close(outs[0][start : start + s].double(), want, atol=2e-5, rtol=2e-5)
        start += s


def test_pse_shift_is_an_additive_bias_on_the_scaled_scores():
    # unconfirmed on device: before or after the scale; the reference adds it after.
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 3, 8, generator=gen) for _ in range(3))  # BNSD
    pse = torch.randn(1, 2, 3, 3, generator=gen)
    out, _ = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=2, input_layout="BNSD", scale=0.5, pse_shift=pse
    )
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + pse, dim=-1) @ v
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lse", [False, True])
def test_empty_kv_gives_zeros_and_empty_query_gives_empty_output(lse):
    cache = torch.randn(3, 4, 16)
    table = torch.tensor([[1], [2]], dtype=torch.int32)
    out, softmax_lse = npu.npu_fused_infer_attention_score(
        torch.randn(3, 2, 8),
        cache,
        cache,
        num_heads=2,
        input_layout="TND",
        block_table=table,
        block_size=4,
        actual_seq_lengths=[1, 3],
        actual_seq_lengths_kv=[0, 0],
        softmax_lse_flag=lse,
    )
    assert out.shape == (3, 2, 8) and torch.count_nonzero(out) == 0
    if lse:
        assert torch.isneginf(softmax_lse).all()
    out, _ = npu.npu_fused_infer_attention_score(
        torch.randn(0, 2, 8),
        cache,
        cache,
        num_heads=2,
        input_layout="TND",
        block_table=table[:1],
        block_size=4,
        actual_seq_lengths=[0],
        actual_seq_lengths_kv=[3],
    )
    assert out.shape == (0, 2, 8)
