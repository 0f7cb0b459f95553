"""FA layouts, dense and paged KV forms, and every sparse mode against naive attention."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from ops_golden import (
    CAUSAL_TILE,
    INT_MAX,
    make_paged_case,
    naive_request,
    pack,
    rule_for,
    tolerance,
    unpack,
)


def run_dense(
    layout,
    q_lens,
    kv_lens,
    n,
    kvn,
    mode,
    *,
    mask=None,
    pre=INT_MAX,
    nxt=INT_MAX,
    dtype=torch.float32,
    version=1,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    d = 8
    qs = [torch.randn(s, n, d, generator=gen).to(dtype) for s in q_lens]
    ks = [torch.randn(s, kvn, d, generator=gen).to(dtype) for s in kv_lens]
    vs = [torch.randn(s, kvn, d, generator=gen).to(dtype) for s in kv_lens]
    q_layout, _, out_layout = layout.partition("_")
    out_layout = out_layout or q_layout
    packed = q_layout in ("TND", "NTD")
    q = pack(qs, q_layout, max(q_lens))
    k = pack(ks, q_layout, max(kv_lens))
    v = pack(vs, q_layout, max(kv_lens))
    cum = lambda xs: torch.tensor(xs).cumsum(0).tolist()  # noqa: E731
    q_arg = cum(q_lens) if packed else q_lens
    kv_arg = cum(kv_lens) if packed else kv_lens
    common = dict(
        input_layout=layout,
        num_key_value_heads=kvn,
        atten_mask=mask,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=nxt,
    )
    if version == 1:
        out, lse = npu.npu_fused_infer_attention_score(
            q,
            k,
            v,
            num_heads=n,
            scale=0.3,
            actual_seq_lengths=q_arg,
            actual_seq_lengths_kv=kv_arg,
            softmax_lse_flag=True,
            **common,
        )
    else:
        out, lse = npu.npu_fused_infer_attention_score_v2(
            q,
            k,
            v,
            num_query_heads=n,
            softmax_scale=0.3,
            actual_seq_qlen=q_arg,
            actual_seq_kvlen=kv_arg,
            return_softmax_lse=True,
            **common,
        )
    return out, lse, (qs, ks, vs, out_layout)


MASK_RULES = {
    # mode 0 with a user mask: not masked and inside the top-left aligned [i - pre, i + next]
    0: lambda m, pre, nxt: lambda i, j, s1, s2: (not m[i, j]) and i - pre <= j <= i + nxt,
    1: lambda m, pre, nxt: lambda i, j, s1, s2: not m[i, j],
}


def check(out, lse, data, lens_q, n, rule, dtype=torch.float32):
    qs, ks, vs, out_layout = data
    got = unpack(out, out_layout, lens_q, n)
    lse_rows = lse[..., 0]
    for b, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        want, want_lse = naive_request(q, k, v, 0.3, rule)
        torch.testing.assert_close(got[b].double(), want, **tolerance(dtype))
        if out_layout in ("TND", "NTD") or lse.dim() == 3:
            start = sum(lens_q[:b])
            got_lse = lse_rows[start : start + lens_q[b]]
        else:
            got_lse = lse_rows[b, :, : lens_q[b]].transpose(0, 1)
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(got_lse.double()[finite], want_lse[finite], atol=1e-3, rtol=1e-3)
        assert torch.isinf(got_lse[~finite]).all()


LAYOUTS = [
    "BSH",
    "BSND",
    "BNSD",
    "TND",
    "NTD",
    "TND_NTD",
    "NTD_TND",
    "BNSD_BSND",
    "BSND_NBSD",
    "BSH_NBSD",
    "BNSD_NBSD",
    "BSH_BNSD",
    "BSND_BNSD",
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", [0, 2, 3])
def test_dense_kv_every_layout(layout, mode):
    q_lens, kv_lens = [4, 2], [6, 5]
    n, kvn = 4, 2
    mask = CAUSAL_TILE if mode else None
    if layout.partition("_")[0] in ("TND", "NTD") and mode == 2:
        # packed prefill takes sparse modes 0 (no mask), 3 and 4 only (npu_ops.md §9)
        with pytest.raises(npu.OpInputError, match="takes sparse_mode 0 without a mask or 3/4"):
            run_dense(layout, q_lens, kv_lens, n, kvn, mode, mask=mask)
        return
    out, lse, data = run_dense(layout, q_lens, kv_lens, n, kvn, mode, mask=mask)
    check(out, lse, data, q_lens, n, rule_for(mode))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_lens,kv_lens", [([5], [5]), ([1, 1], [6, 4]), ([3, 3], [3, 3])])
def test_outputs_are_contiguous_like_the_devices_fresh_tensors(layout, q_lens, kv_lens):
    # One request's prefill, a decode step and equal lengths are where a view of the padded
    # result could leak out; model code then calls .view on the output.
    out, lse, _ = run_dense(layout, q_lens, kv_lens, 4, 2, 3, mask=CAUSAL_TILE)
    assert out.is_contiguous() and lse.is_contiguous()
    out.view(-1)


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
@pytest.mark.parametrize("pre,nxt", [(1, 0), (2, 1), (INT_MAX, 0), (3, -1)])
def test_mode0_mask_with_pre_next_is_top_left_aligned(layout, pre, nxt):
    q_lens, kv_lens = [5, 3], [7, 6]
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(5, 7, generator=gen) > 0.7
    out, lse, data = run_dense(layout, q_lens, kv_lens, 4, 1, 0, mask=mask, pre=pre, nxt=nxt)
    check(out, lse, data, q_lens, 4, MASK_RULES[0](mask, pre, nxt))


def test_packed_prefill_rejects_a_mode0_mask():
    # TND prefill takes mode 0 only without a mask (doc: TND场景下...综合限制)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    with pytest.raises(npu.OpInputError, match="got sparse_mode=0 with atten_mask"):
        run_dense("TND", [5, 3], [7, 6], 4, 1, 0, mask=mask, pre=1, nxt=0)


@pytest.mark.parametrize("mask_shape", ["2d", "b3d", "b4d"])
def test_mode1_all_mask_ignores_pre_next(mask_shape):
    q_lens, kv_lens = [4, 3], [5, 6]
    gen = torch.Generator().manual_seed(6)
    base = torch.rand(2, 4, 6, generator=gen) > 0.6
    mask = {"2d": base[0], "b3d": base, "b4d": base.unsqueeze(1)}[mask_shape].to(torch.uint8)
    out, lse, data = run_dense("BNSD", q_lens, kv_lens, 2, 2, 1, mask=mask, pre=0, nxt=0)
    qs, ks, vs, _ = data
    for b in range(2):
        m = base[0] if mask_shape == "2d" else base[b]
        want, _ = naive_request(qs[b], ks[b], vs[b], 0.3, MASK_RULES[1](m, 0, 0))
        torch.testing.assert_close(
            out[b, :, : q_lens[b]].transpose(0, 1).double(), want, atol=2e-5, rtol=2e-5
        )


@pytest.mark.parametrize("version", [1, 2])
def test_mode3_and_4_on_padded_layout_align_bottom_right(version):
    q_lens, kv_lens = [3, 2], [7, 4]
    out, lse, data = run_dense(
        "BSND", q_lens, kv_lens, 4, 2, 4, mask=CAUSAL_TILE, pre=2, nxt=0, version=version
    )
    check(out, lse, data, q_lens, 4, rule_for(4, 2, 0))


def test_query_longer_than_kv_in_mode3_leaves_first_rows_empty():
    # S1 > S2: the first S1 - S2 rows have no key; the reference writes zeros (unconfirmed).
    out, lse, data = run_dense("TND", [5], [3], 2, 2, 3, mask=CAUSAL_TILE)
    assert torch.count_nonzero(out[:2]) == 0
    check(out, lse, data, [5], 2, rule_for(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_half_precision_dense(dtype, layout):
    out, lse, data = run_dense(layout, [3, 4], [5, 4], 4, 4, 3, mask=CAUSAL_TILE, dtype=dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    check(out, lse, data, [3, 4], 4, rule_for(3), dtype=dtype)


# --- decode branch: one query token in BSH/BSND/BNSD --------------------------------------


def _decode_inputs(kv_lens, n=4, kvn=2, d=8, seed=7):
    case = make_paged_case(
        [1] * len(kv_lens),
        kv_lens,
        num_heads=n,
        num_kv_heads=kvn,
        head_dim=d,
        block_size=4,
        seed=seed,
    )
    nb, bs = case.key_cache.shape[:2]
    q_bsh = torch.stack(case.qs).reshape(len(kv_lens), 1, n * d)
    return case, q_bsh, case.key_cache.view(nb, bs, -1), case.value_cache.view(nb, bs, -1)


def test_decode_branch_ignores_sparse_mode_and_window():
    # BSH with q_len 1 takes the single-query kernel: sparse_mode 4 and pre_tokens do nothing.
    case, q, k, v = _decode_inputs([9, 5])
    out, _ = npu.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=4,
        num_key_value_heads=2,
        input_layout="BSH",
        scale=0.3,
        atten_mask=CAUSAL_TILE,
        sparse_mode=4,
        pre_tokens=1,
        next_tokens=0,
        block_table=case.block_table,
        block_size=4,
        actual_seq_lengths_kv=case.kv_lens,
    )
    for b in range(2):
        want, _ = naive_request(case.qs[b], case.ks[b], case.vs[b], 0.3, rule_for(0))
        torch.testing.assert_close(out[b].view(1, 4, 8).double(), want, atol=2e-5, rtol=2e-5)
    # The same request in TND keeps the window (prefill-branch semantics).
    out_tnd, _ = npu.npu_fused_infer_attention_score(
        torch.cat(case.qs),
        k,
        v,
        num_heads=4,
        num_key_value_heads=2,
        input_layout="TND",
        scale=0.3,
        atten_mask=CAUSAL_TILE,
        sparse_mode=4,
        pre_tokens=1,
        next_tokens=0,
        block_table=case.block_table,
        block_size=4,
        actual_seq_lengths=[1, 2],
        actual_seq_lengths_kv=case.kv_lens,
    )
    want, _ = naive_request(case.qs[0], case.ks[0], case.vs[0], 0.3, rule_for(4, 1, 0))
    torch.testing.assert_close(out_tnd[:1].double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", [(2, 16), (2, 1, 16), (2, 1, 1, 16)])
def test_decode_branch_per_request_key_mask(shape):
    case, q, k, v = _decode_inputs([9, 5])
    mask = torch.zeros(2, 16, dtype=torch.bool)  # >= block_table width x block_size
    mask[0, 3] = mask[0, 7] = mask[1, 0] = True
    out, _ = npu.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=4,
        num_key_value_heads=2,
        input_layout="BSH",
        scale=0.3,
        atten_mask=mask.view(shape),
        block_table=case.block_table,
        block_size=4,
        actual_seq_lengths_kv=case.kv_lens,
    )
    for b in range(2):
        keep = lambda i, j, s1, s2, b=b: not mask[b, j]  # noqa: E731
        want, _ = naive_request(case.qs[b], case.ks[b], case.vs[b], 0.3, keep)
        torch.testing.assert_close(out[b].view(1, 4, 8).double(), want, atol=2e-5, rtol=2e-5)


# --- paged KV in 4-D and 5-D (NZ) forms -----------------------------------------------------


def to_4d(cache):  # [nb, bs, N, D] -> [nb, N, bs, D]
    return cache.permute(0, 2, 1, 3).contiguous()


def to_nz(cache, c0=16):  # [nb, bs, N, D] -> [nb, N, D // c0, bs, c0]
    nb, bs, n, d = cache.shape
    return cache.view(nb, bs, n, d // c0, c0).permute(0, 2, 3, 1, 4).contiguous()


@pytest.mark.parametrize("form", ["3d", "4d", "nz"])
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
def test_paged_cache_forms(form, layout, heads):
    n, kvn = heads
    q_lens = [3, 3] if layout == "BNSD" else [2, 5]
    case = make_paged_case(
        q_lens, [7, 13], num_heads=n, num_kv_heads=kvn, head_dim=32, block_size=4, seed=11
    )
    nb, bs = case.key_cache.shape[:2]
    convert = {"3d": lambda c: c.view(nb, bs, -1), "4d": to_4d, "nz": to_nz}[form]
    q = case.query_tnd if layout == "TND" else torch.stack(case.qs).transpose(1, 2)
    q_arg = case.cu_q if layout == "TND" else q_lens
    out, _ = npu.npu_fused_infer_attention_score_v2(
        q,
        convert(case.key_cache),
        convert(case.value_cache),
        num_query_heads=n,
        num_key_value_heads=kvn,
        input_layout=layout,
        softmax_scale=0.2,
        atten_mask=CAUSAL_TILE,
        sparse_mode=3,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_qlen=q_arg,
        actual_seq_kvlen=case.kv_lens,
    )
    got = list(out.split(q_lens)) if layout == "TND" else [o.transpose(0, 1) for o in out]
    for b in range(2):
        want, _ = naive_request(case.qs[b], case.ks[b], case.vs[b], 0.2, rule_for(3))
        torch.testing.assert_close(got[b].double(), want, atol=2e-5, rtol=2e-5)


def test_bsh_paged_with_padded_query_rows_outputs_zeros_there():
    # BSH prefill with per-batch q lengths shorter than S: padded rows come back as zeros
    # (unconfirmed on device, most likely zero-initialised).
    case = make_paged_case(
        [2, 4], [6, 4], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, seed=12
    )
    q = torch.zeros(2, 4, 2, 8)
    q[0, :2], q[1] = case.qs[0], case.qs[1]
    nb, bs = case.key_cache.shape[:2]
    out, _ = npu.npu_fused_infer_attention_score(
        q.view(2, 4, 16),
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_heads=2,
        num_key_value_heads=1,
        input_layout="BSH",
        scale=0.3,
        atten_mask=CAUSAL_TILE,
        sparse_mode=3,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_lengths=[2, 4],
        actual_seq_lengths_kv=case.kv_lens,
    )
    assert torch.count_nonzero(out[0, 2:]) == 0
    for b, s in enumerate([2, 4]):
        want, _ = naive_request(case.qs[b], case.ks[b], case.vs[b], 0.3, rule_for(3))
        torch.testing.assert_close(out[b, :s].view(s, 2, 8).double(), want, atol=2e-5, rtol=2e-5)


def test_user_mask_only_needs_to_cover_the_actual_lengths():
    # Padded BSH query (S = 4) and KV (S_kv = 7) with shorter actual lengths: a mode-0 mask of
    # exactly (max q len, max kv len) is enough.
    gen = torch.Generator().manual_seed(9)
    q_lens, kv_lens = [2, 3], [4, 6]
    qs = [torch.randn(s, 2, 8, generator=gen) for s in q_lens]
    ks = [torch.randn(s, 2, 8, generator=gen) for s in kv_lens]
    vs = [torch.randn(s, 2, 8, generator=gen) for s in kv_lens]
    mask = torch.rand(3, 6, generator=gen) > 0.5
    mask[:, 0] = False
    out, _ = npu.npu_fused_infer_attention_score(
        pack(qs, "BSH", 4),
        pack(ks, "BSH", 7),
        pack(vs, "BSH", 7),
        num_heads=2,
        input_layout="BSH",
        scale=0.3,
        atten_mask=mask,
        actual_seq_lengths=q_lens,
        actual_seq_lengths_kv=kv_lens,
    )
    got = unpack(out, "BSH", q_lens, 2)
    for b in range(2):
        keep = lambda i, j, s1, s2: not mask[i, j]  # noqa: E731
        want, _ = naive_request(qs[b], ks[b], vs[b], 0.3, keep)
        torch.testing.assert_close(got[b].double(), want, atol=2e-5, rtol=2e-5)
