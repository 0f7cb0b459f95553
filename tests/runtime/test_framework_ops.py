"""Reference operators the framework's models call, against naive math written here.

Loops run over rows, tokens and experts in float64, following each operator's formula in
torch_npu 2.13.0's ``_op_plugin_docs.py`` (or, where the wheel has none, the op-plugin page).
"""

from __future__ import annotations

import math

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import (
    OpInputError,
    ReferenceUnsupportedError,
    RefusedOperatorError,
)

# --- norms and activation ------------------------------------------------------------------


def naive_rms_norm(x, gamma, eps):
    """Each row over the trailing gamma dims: x / sqrt(mean(x^2) + eps) * gamma."""
    lead = x.shape[: x.dim() - gamma.dim()]
    rows = x.double().reshape(-1, gamma.numel())
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        ms = sum(float(v) ** 2 for v in rows[r]) / gamma.numel()
        out[r] = rows[r] / math.sqrt(ms + eps) * gamma.double().reshape(-1)
    return out.reshape(*lead, *gamma.shape)


def test_rms_norm_normalises_over_the_gamma_dims_and_returns_rstd():
    torch.manual_seed(0)
    x, gamma = torch.randn(2, 3, 8), torch.randn(8)
    y, rstd = npu.npu_rms_norm(x, gamma, epsilon=1e-5)
    torch.testing.assert_close(y.double(), naive_rms_norm(x, gamma, 1e-5), rtol=1e-5, atol=1e-6)
    assert rstd.shape == (2, 3, 1) and rstd.dtype == torch.float32
    # a 2-D gamma covers the last two axes (per-head norms in one call)
    gamma2 = torch.randn(3, 8)
    y2, rstd2 = npu.npu_rms_norm(x, gamma2)
    torch.testing.assert_close(y2.double(), naive_rms_norm(x, gamma2, 1e-6), rtol=1e-5, atol=1e-6)
    assert rstd2.shape == (2, 1, 1)


def test_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum():
    torch.manual_seed(1)
    x1, x2, gamma = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    y, _, total = npu.npu_add_rms_norm(x1, x2, gamma, 1e-6)
    torch.testing.assert_close(total, x1 + x2)
    torch.testing.assert_close(
        y.double(), naive_rms_norm(x1 + x2, gamma, 1e-6), rtol=1e-5, atol=1e-6
    )


def test_norms_reject_what_the_documentation_excludes():
    with pytest.raises(OpInputError, match="2-D to 8-D"):
        npu.npu_rms_norm(torch.randn(8), torch.randn(8))
    with pytest.raises(OpInputError, match="x's dtype"):
        npu.npu_rms_norm(torch.randn(2, 8), torch.randn(8, dtype=torch.float16))
    with pytest.raises(OpInputError, match="trailing dims"):
        npu.npu_rms_norm(torch.randn(2, 8), torch.randn(4))
    with pytest.raises(OpInputError, match="float16, bfloat16, float32"):
        npu.npu_rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32))


def test_swiglu_is_silu_of_the_first_half_times_the_second():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 6)
    for dim in (-1, 1):
        a, b = x.double().chunk(2, dim=dim)
        want = a / (1 + torch.exp(-a)) * b
        torch.testing.assert_close(npu.npu_swiglu(x, dim=dim).double(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(OpInputError, match="even size"):
        npu.npu_swiglu(torch.randn(2, 5))


# --- rotary ---------------------------------------------------------------------------------


def naive_rotary(x, cos, sin, mode):
    """Per channel j: x_new[j] pairs j with its partner (half: j +- D/2, interleave: j ^ 1)."""
    d = x.shape[-1]
    x, cos, sin = x.double(), cos.double().expand(x.shape), sin.double().expand(x.shape)
    out = torch.empty_like(x)
    for j in range(d):
        if mode == "half":
            partner = -x[..., j + d // 2] if j < d // 2 else x[..., j - d // 2]
        else:
            partner = -x[..., j + 1] if j % 2 == 0 else x[..., j - 1]
        out[..., j] = cos[..., j] * x[..., j] + sin[..., j] * partner
    return out


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_matches_the_documented_formula(mode):
    torch.manual_seed(3)
    x = torch.randn(2, 3, 5, 8)  # BSND
    cos, sin = torch.rand(1, 3, 1, 8), torch.rand(1, 3, 1, 8)  # 1S1D broadcasts
    got = npu.npu_rotary_mul(x, cos, sin, rotary_mode=mode)
    torch.testing.assert_close(got.double(), naive_rotary(x, cos, sin, mode), rtol=1e-6, atol=1e-6)


def test_rotary_mul_with_the_documented_half_rotate_matrix_equals_half_mode():
    torch.manual_seed(4)
    x, cos, sin = torch.randn(1, 2, 3, 8), torch.rand(1, 1, 3, 8), torch.rand(1, 1, 3, 8)
    rotate = torch.zeros(8, 8)
    rotate[:4, 4:], rotate[4:, :4] = torch.eye(4), -torch.eye(4)
    torch.testing.assert_close(
        npu.npu_rotary_mul(x, cos, sin, "half", rotate), npu.npu_rotary_mul(x, cos, sin, "half")
    )
    with pytest.raises(OpInputError, match="broadcast"):
        npu.npu_rotary_mul(x, torch.rand(1, 1, 4, 8), sin)


def test_apply_rotary_pos_emb_rotates_query_and_key_in_place():
    torch.manual_seed(5)
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)  # BSND, GQA key
    cos, sin = torch.rand(2, 3, 1, 8), torch.rand(2, 3, 1, 8)
    want_q, want_k = naive_rotary(q, cos, sin, "half"), naive_rotary(k, cos, sin, "half")
    # the framework passes layout="BSH" with 4-D tensors; the adapter reads it as BSND
    q_out, k_out = npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="BSH")
    assert q_out is q and k_out is k
    torch.testing.assert_close(q.double(), want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.double(), want_k, rtol=1e-6, atol=1e-6)
    # TND: tokens first, no batch axis
    qt, kt, ct, st = q[0].clone(), k[0].clone(), cos[0], sin[0]
    npu.npu_apply_rotary_pos_emb(qt, kt, ct, st, "TND")
    torch.testing.assert_close(
        qt.double(), naive_rotary(q[0], ct, st, "half"), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ReferenceUnsupportedError, match="Atlas 350"):
        npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="BNSD")
    with pytest.raises(OpInputError, match=r"cos/sin be \[\.\.\., 1, 8\]"):
        npu.npu_apply_rotary_pos_emb(q, k, torch.rand(2, 3, 4, 8), torch.rand(2, 3, 4, 8))


# --- MoE ------------------------------------------------------------------------------------


def test_gating_top_k_softmax_picks_the_largest_probabilities():
    torch.manual_seed(6)
    x = torch.randn(5, 6)
    y, idx, row_idx = npu.npu_moe_gating_top_k_softmax(x, None, k=2)
    for r in range(5):
        exps = [math.exp(float(v)) for v in x[r]]
        probs = [e / sum(exps) for e in exps]
        best = sorted(range(6), key=lambda e: -probs[e])[:2]
        assert idx[r].tolist() == best
        assert y[r].tolist() == pytest.approx([probs[e] for e in best], rel=1e-5)
        assert row_idx[r].tolist() == [r, 5 + r]  # choice-major numbering
    assert idx.dtype == row_idx.dtype == torch.int32
    with pytest.raises(OpInputError, match="k must be"):
        npu.npu_moe_gating_top_k_softmax(x, k=7)
    with pytest.raises(ReferenceUnsupportedError, match="finished"):
        npu.npu_moe_gating_top_k_softmax(x, torch.zeros(5, dtype=torch.bool), k=1)


def routing_kwargs(**over):
    args = dict(expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    args.update(over)
    return args


def test_init_routing_v2_follows_the_worked_example():
    x = torch.arange(3.0).repeat_interleave(2).view(3, 2)  # row r holds [r, r]
    expert_idx = torch.tensor([[2, 0], [1, 2], [0, 3]], dtype=torch.int32)
    ex, row_idx, counts, _ = npu.npu_moe_init_routing_v2(x, expert_idx, **routing_kwargs())
    assert ex[:, 0].tolist() == [0, 2, 1, 0, 1, 2]
    assert row_idx.tolist() == [3, 0, 2, 4, 1, 5] and row_idx.dtype == torch.int32
    assert counts.tolist() == [2, 1, 2, 1] and counts.dtype == torch.int64
    # scatter-type index: by destination, the source each row came from
    _, scatter, _, _ = npu.npu_moe_init_routing_v2(x, expert_idx, **routing_kwargs(row_idx_type=1))
    assert scatter.tolist() == [1, 4, 2, 0, 3, 5]
    # experts [1, 3) only: four selections stay, the rest are -1 / zero rows
    ex, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, expert_idx, **routing_kwargs(active_expert_range=[1, 3])
    )
    assert row_idx.tolist() == [1, -1, 0, 2, -1, -1]
    assert ex[:, 0].tolist() == [1, 0, 1, 0, 0, 0] and counts.tolist() == [1, 2]
    # key_value mode: (expert, count) pairs of busy experts, then a (0, 0) terminator
    kv = npu.npu_moe_init_routing_v2(
        x, expert_idx, **routing_kwargs(expert_num=6, expert_tokens_num_type=2)
    )[2]
    assert kv.tolist() == [[0, 2], [1, 1], [2, 2], [3, 1], [0, 0], [0, 0]]


def test_init_routing_v2_refuses_quantization_and_undocumented_modes():
    x, idx = torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(RefusedOperatorError, match="quantized"):
        npu.npu_moe_init_routing_v2(x, idx, **routing_kwargs(quant_mode=1))
    with pytest.raises(OpInputError, match="当前仅支持1和2"):
        npu.npu_moe_init_routing_v2(x, idx, **routing_kwargs(expert_tokens_num_type=0))
    with pytest.raises(OpInputError, match=r"\[0, 4\)"):
        npu.npu_moe_init_routing_v2(x, idx + 4, **routing_kwargs())


def naive_moe(x, gate_logits, top_k, w13, w2):
    """Per token: softmax top-k experts, each a SwiGLU MLP, outputs summed by router weight."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(gate_logits[t].double(), dim=-1)
        for e in sorted(range(probs.numel()), key=lambda e: -float(probs[e]))[:top_k]:
            h = x[t].double() @ w13[e].double()
            gate, up = h.chunk(2)
            out[t] += probs[e] * ((gate * torch.sigmoid(gate) * up) @ w2[e].double())
    return out


def test_routing_grouped_matmul_and_finalize_compose_into_the_moe_layer():
    # the framework's expert path: gate -> init_routing_v2 -> gmm -> swiglu -> gmm -> finalize
    torch.manual_seed(7)
    tokens, hidden, inter, experts, top_k = 6, 8, 4, 4, 2
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
    w13, w2 = torch.randn(experts, hidden, 2 * inter), torch.randn(experts, inter, hidden)
    weights, idx, _ = npu.npu_moe_gating_top_k_softmax(logits, None, k=top_k)
    ex, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, idx, active_num=tokens * top_k, **routing_kwargs(active_expert_range=[0, experts])
    )
    h = npu.npu_grouped_matmul(
        [ex], [w13], group_list=counts, group_type=0, group_list_type=1, split_item=3
    )[0]
    h = npu.npu_grouped_matmul(
        [npu.npu_swiglu(h)], [w2], group_list=counts.cumsum(0), group_type=0, split_item=3
    )[0]
    out = npu.npu_moe_finalize_routing(h, None, None, None, weights, row_idx, None, drop_pad_mode=2)
    torch.testing.assert_close(
        out.double(), naive_moe(x, logits, top_k, w13, w2), rtol=1e-4, atol=1e-4
    )


def test_finalize_routing_reads_choice_major_indices_in_mode_0_and_adds_bias_and_skips():
    torch.manual_seed(8)
    rows, k, hidden, experts = 3, 2, 4, 5
    expanded = torch.randn(rows * k, hidden)
    perm = torch.randperm(rows * k).to(torch.int32)
    scales, expert_of = torch.rand(rows, k), torch.randint(0, experts, (rows, k), dtype=torch.int32)
    bias, skip1, skip2 = (
        torch.randn(experts, hidden),
        torch.randn(rows, hidden),
        torch.randn(rows, hidden),
    )
    got = npu.npu_moe_finalize_routing(expanded, skip1, skip2, bias, scales, perm, expert_of, 0)
    want = skip1.double() + skip2.double()
    for i in range(rows):
        for c in range(k):
            row = expanded[int(perm[c * rows + i])].double() + bias[int(expert_of[i, c])].double()
            want[i] += float(scales[i, c]) * row
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ReferenceUnsupportedError, match="drop/pad"):
        npu.npu_moe_finalize_routing(expanded, None, None, None, scales, perm, None, 1)


def test_re_routing_orders_tokens_expert_major_and_returns_the_gather_index():
    # 2 ranks x 3 local experts; tokens arrive rank-major
    counts = torch.tensor([[1, 0, 2], [2, 1, 0]], dtype=torch.int32)
    tokens = torch.arange(6.0).view(6, 1).expand(6, 3).contiguous()
    scales = torch.arange(6.0) / 10
    out, out_scales, gather, per_expert = npu.npu_moe_re_routing(
        tokens, counts, per_token_scales=scales
    )
    want, start = [], 0
    blocks = {}
    for r in range(2):
        for e in range(3):
            blocks[(r, e)] = list(range(start, start + int(counts[r, e])))
            start += int(counts[r, e])
    for e in range(3):
        for r in range(2):
            want += blocks[(r, e)]
    assert gather.tolist() == want and gather.dtype == torch.int32
    assert out[:, 0].tolist() == [float(v) for v in want]
    torch.testing.assert_close(out_scales, scales[want])
    assert per_expert.tolist() == [3, 1, 2]


def test_grouped_matmul_list_form_and_refusals():
    torch.manual_seed(9)
    xs, ws, bs = (
        [torch.randn(2, 3), torch.randn(4, 3)],
        [torch.randn(3, 5), torch.randn(3, 2)],
        None,
    )
    outs = npu.npu_grouped_matmul(xs, ws)
    for x, w, y in zip(xs, ws, outs, strict=True):
        torch.testing.assert_close(y, x @ w)
    bs = [torch.randn(5), torch.randn(5)]
    ys = npu.npu_grouped_matmul([xs[0], xs[0]], [ws[0], ws[0]], bias=bs, split_item=2)
    assert len(ys) == 1 and ys[0].shape == (4, 5)
    torch.testing.assert_close(ys[0][2:], xs[0] @ ws[0] + bs[1])
    with pytest.raises(RefusedOperatorError, match="quantized"):
        npu.npu_grouped_matmul(xs, ws, scale=[torch.ones(5), torch.ones(2)])
    with pytest.raises(OpInputError, match="non-decreasing"):
        npu.npu_grouped_matmul(
            [torch.randn(4, 3)],
            [torch.randn(2, 3, 5)],
            group_list=torch.tensor([3, 1]),
            group_type=0,
        )


# --- expert-parallel dispatch / combine at one rank ------------------------------------------


def _dispatch_one_rank(x, expert_ids, **kwargs):
    return npu.npu_moe_distribute_dispatch_v2(
        x, expert_ids, "cpu-one-rank", 1, 0, 4, tp_world_size=1, shared_expert_num=0, **kwargs
    )


def test_dispatch_sorts_each_tokens_copies_by_expert_and_combine_weighs_them_back():
    # the worked example of moe_distribute.py: 3 tokens, K 2, experts 0..3
    torch.manual_seed(11)
    x = torch.randn(3, 8).to(torch.bfloat16)
    expert_ids = torch.tensor([[2, 0], [1, 2], [0, 3]], dtype=torch.int32)
    out = _dispatch_one_rank(x, expert_ids)
    expand_x, _, assist, token_nums, ep_recv, tp_recv, _ = out
    # rows grouped by expert, stable: copies 1, 4 | 2 | 0, 3 | 5 -> tokens 0, 2, 1, 0, 1, 2
    assert torch.equal(expand_x, x[[0, 2, 1, 0, 1, 2]])
    assert token_nums.tolist() == [2, 1, 2, 1] and token_nums.dtype == torch.int64
    assert ep_recv.tolist() == [2, 1, 2, 1] and tp_recv.tolist() == [6]
    assert assist.shape == (6 * 128,) and assist.dtype == torch.int32
    # each expert doubles its rows by its index + 1; the combine must give, per token, the
    # naive sum over its K choices of weight * (expert + 1) * x
    factor = torch.tensor([1.0, 1.0, 2.0, 3.0, 3.0, 4.0]).unsqueeze(-1)  # experts 0 0 1 2 2 3
    scales = torch.rand(3, 2)
    combined = npu.npu_moe_distribute_combine_v2(
        (expand_x.float() * factor).to(torch.bfloat16), expert_ids, assist, ep_recv, scales,
        "cpu-one-rank", 1, 0, 4, tp_send_counts=tp_recv, tp_world_size=1, shared_expert_num=0,
    )  # fmt: skip
    naive = torch.zeros(3, 8)
    for t in range(3):
        for k in range(2):
            naive[t] += scales[t, k] * (int(expert_ids[t, k]) + 1) * x[t].float()
    assert combined.dtype == torch.bfloat16
    torch.testing.assert_close(combined.float(), naive, rtol=1.6e-2, atol=1e-2)
    cumsum = _dispatch_one_rank(x, expert_ids, expert_token_nums_type=0)[3]
    assert cumsum.tolist() == [2, 3, 5, 6]


def test_dispatch_refuses_more_than_one_rank_quantization_and_float32_by_name():
    x, ids = torch.randn(2, 8).to(torch.bfloat16), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(RefusedOperatorError, match="one rank only"):
        npu.npu_moe_distribute_dispatch_v2(x, ids, "hcom", 2, 0, 4)
    with pytest.raises(RefusedOperatorError, match="quantized"):
        _dispatch_one_rank(x, ids, quant_mode=4)
    with pytest.raises(OpInputError, match="bfloat16"):
        _dispatch_one_rank(x.float(), ids)
    with pytest.raises(OpInputError, match="must differ"):
        _dispatch_one_rank(x, torch.tensor([[1, 1], [2, 3]], dtype=torch.int32))
    with pytest.raises(OpInputError, match="group_ep"):
        npu.npu_moe_distribute_dispatch_v2(x, ids, None, 1, 0, 4)


# --- refused by name ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["npu_quant_matmul", "npu_dynamic_quant", "npu_swiglu_mx_quant"])
def test_quantized_operators_are_refused_by_name_in_one_line(name):
    with pytest.raises(RefusedOperatorError) as info:
        getattr(npu, name)(torch.randn(2, 2))
    message = str(info.value)
    assert message.startswith(f"torch_npu.{name}: quantized") and "\n" not in message


def test_collectives_and_the_hifloat8_dtype_are_refused_and_float8_names_are_torchs():
    with pytest.raises(RefusedOperatorError, match="parallel size 1"):
        npu.npu_mm_all_reduce_base(torch.randn(2, 2), torch.randn(2, 2), "hcom")
    with pytest.raises(RefusedOperatorError, match="hifloat8"):
        _ = npu.hifloat8
    assert npu.float8_e4m3fn is torch.float8_e4m3fn
    assert not hasattr(npu, "npu_no_such_operator")


# --- Legacy caches ---------------------------------------------------------------------------


def test_fused_attention_never_reads_keys_past_the_kv_lengths_of_an_uninitialised_cache():
    # the framework's Legacy init_cache allocates with torch.empty: arbitrary bits (NaN, inf)
    # sit past each request's length, which the device never reads
    torch.manual_seed(10)
    q, k, v = torch.randn(2, 1, 32), torch.randn(2, 12, 16), torch.randn(2, 12, 16)
    lens = [6, 4]
    want = torch.zeros(2, 1, 32, dtype=torch.float64)
    for b, s2 in enumerate(lens):
        for h in range(2):  # two query heads share the one kv head
            scores = (q[b, 0, h * 16 : h * 16 + 16].double() @ k[b, :s2].double().t()) * 0.25
            want[b, 0, h * 16 : h * 16 + 16] = torch.softmax(scores, dim=-1) @ v[b, :s2].double()
    k[0, 6:], v[0, 6:] = float("nan"), float("inf")
    k[1, 4:], v[1, 4:] = float("inf"), float("nan")
    for lse_flag in (False, True):
        out, _ = npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=2, num_key_value_heads=1, input_layout="BSH", scale=0.25,
            actual_seq_lengths_kv=lens, softmax_lse_flag=lse_flag,
        )  # fmt: skip
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_documented_size_limits_of_rotary_and_re_routing():
    q, cos = torch.randn(1, 0, 2, 8), torch.rand(1, 0, 1, 8)
    with pytest.raises(OpInputError, match="不支持空Tensor"):
        npu.npu_apply_rotary_pos_emb(q, q.clone(), cos, cos.clone())
    counts = torch.tensor([[1]], dtype=torch.int32)
    with pytest.raises(OpInputError, match=r"token length H must be in \(0, 16384\)"):
        npu.npu_moe_re_routing(torch.zeros(1, 16384), counts)
