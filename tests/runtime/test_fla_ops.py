"""FLA reference operators against naive loops: causal conv1d and the gated delta rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvskill.runtime.ops import fla
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import ReferenceUnsupportedError
from kvskill.runtime.ops.reference._checks import OpInputError

# --- causal conv1d -------------------------------------------------------------------------


def naive_conv(x, weight, bias, init, silu):
    """x [dim, L], init [dim, W-1] -> y [dim, L] by explicit sums."""
    dim, width = weight.shape
    xp = torch.cat((init, x), dim=1).double()
    y = torch.zeros(dim, x.shape[1], dtype=torch.float64)
    for t in range(x.shape[1]):
        for c in range(dim):
            acc = float(bias[c]) if bias is not None else 0.0
            for k in range(width):
                acc += float(weight[c, k]) * float(xp[c, t + k])
            y[c, t] = acc
    return F.silu(y) if silu else y


def test_conv1d_fn_varlen_with_state_lines_and_initial_states():
    torch.manual_seed(0)
    dim, width, state_len = 3, 4, 3
    lens = [5, 2, 4]
    x = torch.randn(dim, sum(lens))
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    states = torch.randn(5, dim, state_len)
    before = states.clone()
    qsl = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    lines = torch.tensor([3, -1, 0], dtype=torch.int32)  # the middle sequence is padding
    has_init = torch.tensor([True, True, False])
    out = fla.causal_conv1d_fn(
        x,
        weight,
        bias,
        states,
        qsl,
        cache_indices=lines,
        has_initial_state=has_init,
        activation="silu",
    )
    # sequence 0 continues from line 3
    want0 = naive_conv(x[:, :5], weight, bias, before[3, :, -3:], silu=True)
    torch.testing.assert_close(out[:, :5].double(), want0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[3], x[:, 2:5])
    # sequence 2 starts from zeros; its state ends with its last W-1 inputs
    want2 = naive_conv(x[:, 7:], weight, bias, torch.zeros(dim, 3), silu=True)
    torch.testing.assert_close(out[:, 7:].double(), want2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], x[:, 8:11])
    # the padded sequence and the untouched lines stay as they were
    assert torch.count_nonzero(out[:, 5:7]) == 0
    for line in (1, 2, 4):
        assert torch.equal(states[line], before[line])


def test_conv1d_short_sequence_keeps_older_state_columns():
    dim, width = 2, 4
    states = torch.arange(6, dtype=torch.float32).view(1, dim, 3)
    x = torch.tensor([[10.0], [20.0]])
    fla.causal_conv1d_fn(
        x,
        torch.ones(dim, width),
        None,
        states,
        torch.tensor([0, 1]),
        has_initial_state=torch.tensor([True]),
        activation=None,
    )
    assert states[0].tolist() == [[1.0, 2.0, 10.0], [4.0, 5.0, 20.0]]


def test_prefill_then_decode_updates_equal_one_long_prefill():
    # State carry-over: prefill 4 tokens, then 3 single-token updates == one 7-token prefill.
    torch.manual_seed(1)
    dim, width = 4, 4
    x = torch.randn(dim, 7)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    whole = fla.causal_conv1d_fn(x, weight, bias, torch.zeros(1, dim, 3), torch.tensor([0, 7]))
    states = torch.zeros(2, dim, 3)
    idx = torch.tensor([1], dtype=torch.int32)
    first = fla.causal_conv1d_fn(
        x[:, :4], weight, bias, states, torch.tensor([0, 4]), cache_indices=idx
    )
    steps = [
        fla.causal_conv1d_update(
            x[:, t].view(1, dim), states, weight, bias, "silu", conv_state_indices=idx
        )
        for t in range(4, 7)
    ]
    got = torch.cat([first] + [s.view(dim, 1) for s in steps], dim=1)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    assert states[0].abs().sum() == 0


def test_conv1d_update_input_forms_agree():
    torch.manual_seed(2)
    dim, width = 3, 3
    weight = torch.randn(dim, width)
    base = torch.randn(2, dim, 2)
    x3 = torch.randn(2, dim, 2)  # [B, dim, L]
    s_a, s_b = base.clone(), base.clone()
    y3 = fla.causal_conv1d_update(x3, s_a, weight)
    packed = x3.transpose(1, 2).reshape(4, dim)  # [T, dim]
    yp = fla.causal_conv1d_update(
        packed, s_b, weight, query_start_loc=torch.tensor([0, 2, 4]), max_query_len=2
    )
    torch.testing.assert_close(yp, y3.transpose(1, 2).reshape(4, dim))
    assert torch.equal(s_a, s_b)
    for b in range(2):
        want = naive_conv(x3[b], weight, None, base[b], silu=False)
        torch.testing.assert_close(y3[b].double(), want, atol=1e-5, rtol=1e-5)


def test_conv1d_update_skips_pad_slot_and_rejects_spec_decode():
    states = torch.randn(2, 2, 2)
    before = states.clone()
    out = fla.causal_conv1d_update(
        torch.ones(1, 2), states, torch.ones(2, 3), conv_state_indices=torch.tensor([-1])
    )
    assert torch.equal(states, before) and out.abs().sum() == 0
    with pytest.raises(ReferenceUnsupportedError, match="num_accepted_tokens"):
        fla.causal_conv1d_update(
            torch.ones(1, 2), states, torch.ones(2, 3), num_accepted_tokens=torch.tensor([1])
        )


# --- gated delta rule ----------------------------------------------------------------------


def naive_gdn(q, k, v, g, beta, scale, h0):
    """One sequence: q, k [T, H, K], v [T, HV, V], g/beta [T, HV], h0 [HV, K, V] (float64)."""
    t_len, h, _ = q.shape
    hv = v.shape[1]
    state = h0.double().clone()
    out = torch.zeros(t_len, hv, v.shape[2], dtype=torch.float64)
    for t in range(t_len):
        for j in range(hv):
            i = j // (hv // h)
            s = state[j] * torch.exp(g[t, j].double())
            kt = k[t, i].double()
            u = beta[t, j].double() * (v[t, j].double() - s.T @ kt)
            s = s + torch.outer(kt, u)
            out[t, j] = s.T @ (q[t, i].double() * scale)
            state[j] = s
    return out, state


def _gdn_inputs(total, h=2, hv=4, kd=4, vd=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, h, kd, generator=gen)
    k = F.normalize(torch.randn(1, total, h, kd, generator=gen), dim=-1)
    v = torch.randn(1, total, hv, vd, generator=gen)
    g = F.logsigmoid(torch.randn(1, total, hv, generator=gen))
    beta = torch.rand(1, total, hv, generator=gen)
    return q, k, v, g, beta


def test_recurrent_varlen_with_state_indices_matches_naive():
    lens = [3, 1, 4]
    q, k, v, g, beta = _gdn_inputs(sum(lens))
    states = torch.randn(6, 4, 4, 3)
    before = states.clone()
    rows = torch.tensor([4, 0, 2])
    o, final = fla.recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=0.7,
        initial_state=states,
        cu_seqlens=torch.tensor([0, 3, 4, 8]),
        ssm_state_indices=rows,
    )
    assert final is states and o.shape == (1, 8, 4, 3)
    start = 0
    for n, length in enumerate(lens):
        sl = slice(start, start + length)
        want_o, want_h = naive_gdn(
            q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl], 0.7, before[rows[n]]
        )
        torch.testing.assert_close(o[0, sl].double(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[rows[n]].double(), want_h, atol=1e-5, rtol=1e-5)
        start += length
    for untouched in (1, 3, 5):
        assert torch.equal(states[untouched], before[untouched])


def test_recurrent_state_carries_over_between_calls():
    q, k, v, g, beta = _gdn_inputs(6, seed=1)
    whole_state = torch.zeros(1, 4, 4, 3)
    o_whole, _ = fla.recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=whole_state, ssm_state_indices=torch.tensor([0])
    )
    state = torch.zeros(1, 4, 4, 3)
    parts = []
    for a, b in ((0, 2), (2, 3), (3, 6)):
        o, _ = fla.recurrent_gated_delta_rule(
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            g[:, a:b],
            beta[:, a:b],
            initial_state=state,
            ssm_state_indices=torch.tensor([0]),
        )
        parts.append(o)
    torch.testing.assert_close(torch.cat(parts, dim=1), o_whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)


def test_recurrent_default_scale_l2norm_and_per_token_states():
    q, k, v, g, beta = _gdn_inputs(3, h=1, hv=1, seed=2)
    states = torch.zeros(4, 1, 4, 3)
    o, per_token = fla.recurrent_gated_delta_rule(
        q * 3,
        k * 2,
        v,
        g,
        beta,
        initial_state=states,
        inplace_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )
    qn = F.normalize(q[0], dim=-1, eps=0)  # l2norm with eps 1e-6 is indistinguishable here
    want_o, want_h = naive_gdn(qn, k[0], v[0], g[0], beta[0], 4**-0.5, torch.zeros(1, 4, 3))
    torch.testing.assert_close(o[0].double(), want_o, atol=1e-4, rtol=1e-4)
    assert per_token.shape == (3, 1, 4, 3) and states.abs().sum() == 0
    torch.testing.assert_close(per_token[-1].double(), want_h, atol=1e-4, rtol=1e-4)


def test_recurrent_two_d_indices_store_the_state_after_every_token():
    q, k, v, g, beta = _gdn_inputs(2, h=1, hv=1, seed=3)
    states = torch.zeros(5, 1, 4, 3)
    fla.recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=states, ssm_state_indices=torch.tensor([[3, 1]])
    )
    _, after_first = naive_gdn(
        q[0, :1], k[0, :1], v[0, :1], g[0, :1], beta[0, :1], 0.5, torch.zeros(1, 4, 3)
    )
    _, after_both = naive_gdn(q[0], k[0], v[0], g[0], beta[0], 0.5, torch.zeros(1, 4, 3))
    torch.testing.assert_close(states[3].double(), after_first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1].double(), after_both, atol=1e-5, rtol=1e-5)


def test_npu_recurrent_uses_value_major_state_and_per_token_slots():
    # Two requests of 2 and 1 tokens; state is [slots, Nv, Dv, Dk] (transposed vs FLA).
    q, k, v, g, beta = _gdn_inputs(3, h=2, hv=4, seed=4)
    state = torch.randn(6, 4, 3, 4)
    before = state.clone()
    slots = torch.tensor([5, 2, 0], dtype=torch.int32)
    out = npu.npu_recurrent_gated_delta_rule(
        q[0],
        k[0],
        v[0],
        state,
        beta=beta[0],
        g=g[0],
        scale=0.5,
        actual_seq_lengths=torch.tensor([2, 1], dtype=torch.int32),
        ssm_state_indices=slots,
    )
    want0, h0 = naive_gdn(
        q[0, :2], k[0, :2], v[0, :2], g[0, :2], beta[0, :2], 0.5, before[5].transpose(-1, -2)
    )
    want1, h1 = naive_gdn(
        q[0, 2:], k[0, 2:], v[0, 2:], g[0, 2:], beta[0, 2:], 0.5, before[0].transpose(-1, -2)
    )
    torch.testing.assert_close(out.double(), torch.cat((want0, want1)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[2].transpose(-1, -2).double(), h0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0].transpose(-1, -2).double(), h1, atol=1e-5, rtol=1e-5)
    assert torch.equal(state[1], before[1])


def test_npu_recurrent_spec_decode_starts_from_the_accepted_token_slot():
    q, k, v, g, beta = _gdn_inputs(3, h=1, hv=1, seed=5)
    state = torch.randn(3, 1, 3, 4)
    before = state.clone()
    out, new_state = npu.npu_recurrent_gated_delta_rule_functional(
        q[0],
        k[0],
        v[0],
        state,
        beta=beta[0],
        g=g[0],
        actual_seq_lengths=torch.tensor([3], dtype=torch.int32),
        ssm_state_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
        num_accepted_tokens=torch.tensor([2], dtype=torch.int32),
    )
    assert torch.equal(state, before)  # functional twin leaves the input alone
    want, _ = naive_gdn(q[0], k[0], v[0], g[0], beta[0], 4**-0.5, before[1].transpose(-1, -2))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(new_state[2], before[2])


def test_npu_recurrent_rejects_long_requests():
    q, k, v, g, beta = _gdn_inputs(9, h=1, hv=1)
    with pytest.raises(RuntimeError, match=r"1\.\.8"):
        npu.npu_recurrent_gated_delta_rule(
            q[0],
            k[0],
            v[0],
            torch.zeros(9, 1, 3, 4),
            actual_seq_lengths=torch.tensor([9], dtype=torch.int32),
        )


def test_fla_chunk_variant_returns_states_without_touching_the_input():
    lens = [3, 2]
    q, k, v, g, beta = _gdn_inputs(sum(lens), seed=6)
    h0 = torch.randn(2, 4, 4, 3)
    before = h0.clone()
    o, final = fla.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=torch.tensor([0, 3, 5]),
    )
    assert torch.equal(h0, before)
    for n, sl in enumerate((slice(0, 3), slice(3, 5))):
        want_o, want_h = naive_gdn(
            q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl], 0.5, before[n]
        )
        torch.testing.assert_close(o[0, sl].double(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[n].double(), want_h, atol=1e-5, rtol=1e-5)
    _, none = fla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 5]))
    assert none is None


def test_npu_chunk_variant_scale_defaults_to_one_and_state_is_value_major():
    lens = [2, 3]
    q, k, v, g, beta = _gdn_inputs(sum(lens), h=2, hv=4, seed=7)
    h0 = torch.randn(2, 4, 3, 4)  # [B, Nv, Dv, Dk]
    out, final = npu.npu_chunk_gated_delta_rule(
        q[0],
        k[0],
        v[0],
        beta=beta[0],
        g=g[0],
        initial_state=h0,
        actual_seq_lengths=torch.tensor(lens, dtype=torch.int32),
    )
    for n, sl in enumerate((slice(0, 2), slice(2, 5))):
        want_o, want_h = naive_gdn(
            q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl], 1.0, h0[n].transpose(-1, -2)
        )
        torch.testing.assert_close(out[sl].double(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            final[n].transpose(-1, -2).double(), want_h, atol=1e-5, rtol=1e-5
        )


# --- Kimi delta attention (decay per key channel) -------------------------------------------


def test_kda_matches_transformers_own_kimi_recurrence():
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    torch.manual_seed(3)
    b, t, h, d = 2, 7, 3, 8
    q, k, v = (torch.randn(b, t, h, d) for _ in range(3))
    g = -torch.rand(b, t, h, d)  # log decay, one per key channel
    beta = torch.rand(b, t, h)
    h0 = torch.randn(b, h, d, d)
    want, want_state = kimi.recurrent_kimi_delta_attention(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    states = h0.clone()
    got, _ = fla.fused_recurrent_kda(
        q, k, v, g, beta, initial_state=states, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, want_state, rtol=1e-5, atol=1e-5)
    # the prefill form over the same two sequences packed into one
    packed = [x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, t, 2 * t], dtype=torch.int32)
    out, final = fla.chunk_kda(
        *packed[:3],
        packed[3],
        packed[4],
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out.view(b, t, h, d), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_state, rtol=1e-5, atol=1e-5)


def test_kda_with_one_decay_per_head_is_the_gated_delta_rule():
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 6, 2, 4) for _ in range(3))
    g_head = -torch.rand(1, 6, 2)
    beta = torch.rand(1, 6, 2)
    gdn, _ = fla.chunk_gated_delta_rule(q, k, v, g_head, beta)
    kda, _ = fla.chunk_kda(q, k, v, g_head[..., None].expand(1, 6, 2, 4), beta)
    torch.testing.assert_close(kda, gdn)
    with pytest.raises(OpInputError, match=r"one log decay per key channel"):
        fla.chunk_kda(q, k, v, g_head, beta)
