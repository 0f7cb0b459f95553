"""Mamba reference operators against a naive token-by-token recurrence written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvskill.runtime.ops import mamba
from kvskill.runtime.ops.reference import ReferenceUnsupportedError
from kvskill.runtime.ops.reference._checks import OpInputError


def naive_scan(x, dt, A, B, C, D, z, h0):
    """One sequence, token by token in float64.

    x [L, H, P], dt [L, H] (already discretised), A [H], B/C [L, G, N], D [H], z [L, H, P] or
    None, h0 [H, P, N]. Returns (y [L, H, P], final state).
    """
    heads, groups = x.shape[1], B.shape[1]
    rep = heads // groups
    h = h0.double().clone()
    ys = []
    for t in range(x.shape[0]):
        for hd in range(heads):
            g = hd // rep
            decay = torch.exp(dt[t, hd].double() * A[hd].double())
            h[hd] = (
                decay * h[hd]
                + dt[t, hd].double() * x[t, hd].double()[:, None] * B[t, g].double()[None, :]
            )
        y = torch.einsum("hpn,hn->hp", h, C[t].double().repeat_interleave(rep, 0))
        y = y + x[t].double() * D.double()[:, None]
        if z is not None:
            y = y * F.silu(z[t].double())
        ys.append(y)
    return torch.stack(ys), h


def _inputs(seed, total, heads=4, headdim=3, groups=2, dstate=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, total, heads, headdim, generator=g)
    dt = torch.randn(1, total, heads, generator=g)
    A = -torch.rand(heads, generator=g) * 2 - 0.1
    B = torch.randn(1, total, groups, dstate, generator=g)
    C = torch.randn(1, total, groups, dstate, generator=g)
    D = torch.randn(heads, generator=g)
    z = torch.randn(1, total, heads, headdim, generator=g)
    bias = torch.randn(heads, generator=g) * 0.1
    return x, dt, A, B, C, D, z, bias


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunk_scan_varlen_matches_naive_recurrence(chunk_size):
    lens = [7, 1, 10]
    cu = torch.tensor([0, 7, 8, 18], dtype=torch.int32)
    x, dt, A, B, C, D, z, bias = _inputs(0, sum(lens))
    h0 = torch.randn(3, 4, 3, 5)
    limit = (0.05, 2.0)
    out, states = mamba.mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=bias, initial_states=h0,
        cu_seqlens=cu, dt_softplus=True, dt_limit=limit, return_varlen_states=True,
    )  # fmt: skip
    step = F.softplus(dt[0] + bias).clamp(*limit)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:], strict=False)):
        y, h = naive_scan(x[0, a:b], step[a:b], A, B[0, a:b], C[0, a:b], D, z[0, a:b], h0[i])
        torch.testing.assert_close(out[0, a:b].double(), y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states[i].double(), h, atol=1e-4, rtol=1e-4)


def test_prefill_then_decode_equals_one_long_prefill():
    """Scan 6 tokens, then 3 single-token updates on the state rows, against a 9-token scan."""
    x, dt, A, B, C, D, _, bias = _inputs(1, 9, groups=1)
    whole = mamba.mamba_chunk_scan_combined(x, dt, A, B, C, 4, D=D, dt_bias=bias, dt_softplus=True)
    out, states = mamba.mamba_chunk_scan_combined(
        x[:, :6], dt[:, :6], A, B[:, :6], C[:, :6], 4, D=D, dt_bias=bias, dt_softplus=True,
        cu_seqlens=torch.tensor([0, 6]), return_varlen_states=True,
    )  # fmt: skip
    torch.testing.assert_close(out, whole[:, :6], atol=1e-5, rtol=1e-5)
    pool = torch.zeros(4, 4, 3, 5)  # state lines; the request owns line 2
    pool[2] = states[0]
    heads, headdim, dstate = 4, 3, 5
    for t in range(6, 9):
        y = mamba.selective_state_update(
            pool,
            x[:, t],
            dt[:, t, :, None].expand(1, heads, headdim),
            A[:, None, None].expand(heads, headdim, dstate),
            B[:, t],
            C[:, t],
            D=D[:, None].expand(heads, headdim),
            dt_bias=bias[:, None].expand(heads, headdim),
            dt_softplus=True,
            state_batch_indices=torch.tensor([2]),
        )
        torch.testing.assert_close(y, whole[:, t], atol=1e-5, rtol=1e-5)
    assert pool[[0, 1, 3]].abs().sum() == 0, "rows of other requests were written"


def test_a_float32_state_under_bfloat16_activations_is_computed_and_kept_in_float32():
    """A pinned SSM state (float32 in a bfloat16 model): both operators compute in float32 from
    the bfloat16 inputs and keep the state in its own dtype, outputs in the activations'."""
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    x, dt, A, B, C, D, _, bias = _inputs(3, 9)
    x, dt, B, C, D, bias = (t.bfloat16() for t in (x, dt, B, C, D, bias))
    h0 = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(4)) / 3
    assert not torch.equal(h0, h0.bfloat16().float()), "the states must not fit in bfloat16"
    out, states = mamba.mamba_chunk_scan_combined(
        x, dt, A, B, C, 4, D=D, dt_bias=bias, initial_states=h0, cu_seqlens=cu,
        dt_softplus=True, return_varlen_states=True,
    )  # fmt: skip
    assert (out.dtype, states.dtype) == (torch.bfloat16, torch.float32)
    step = F.softplus(dt[0].float() + bias.float())
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:], strict=False)):
        y, h = naive_scan(x[0, a:b], step[a:b], A, B[0, a:b], C[0, a:b], D, None, h0[i])
        # a state rounded through bfloat16 anywhere would be ~1e-3 off
        torch.testing.assert_close(states[i].double(), h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[0, a:b].double(), y, atol=3e-2, rtol=2e-2)
    # one decode token per request on the float32 state rows of a pool, in place
    pool = torch.zeros(3, 4, 3, 5)
    lines = torch.tensor([2, 0])
    pool[lines] = states
    xt, dtt, bt, ct = x[0, :2], dt[0, :2], B[0, :2], C[0, :2]
    y = mamba.selective_state_update(
        pool, xt, dtt[:, :, None].expand(2, 4, 3), A[:, None, None].expand(4, 3, 5), bt, ct,
        D=D[:, None].expand(4, 3), dt_bias=bias[:, None].expand(4, 3), dt_softplus=True,
        state_batch_indices=lines,
    )  # fmt: skip
    assert (y.dtype, pool.dtype) == (torch.bfloat16, torch.float32)
    for b, line in enumerate(lines.tolist()):
        want_y, want = naive_scan(
            xt[b : b + 1], step[b : b + 1], A, bt[b : b + 1], ct[b : b + 1], D, None, states[b]
        )
        torch.testing.assert_close(pool[line].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[b].double(), want_y[0], atol=3e-2, rtol=2e-2)
    assert pool[1].abs().sum() == 0, "a row no request owns was written"


def test_state_update_mamba1_form_and_padding_rows():
    """[B, dim, dstate] states: every channel has its own dt and A row; pad rows untouched."""
    g = torch.Generator().manual_seed(2)
    dim, dstate = 6, 4
    state = torch.randn(5, dim, dstate, generator=g)
    before = state.clone()
    x, dt, z = (torch.randn(3, dim, generator=g) for _ in range(3))
    A = -torch.rand(dim, dstate, generator=g)
    B, C = torch.randn(3, dstate, generator=g), torch.randn(3, dstate, generator=g)
    D = torch.randn(dim, generator=g)
    lines = torch.tensor([4, -1, 1])
    y = mamba.selective_state_update(
        state, x, dt, A, B, C, D=D, z=z, dt_softplus=True, state_batch_indices=lines
    )
    for b, line in ((0, 4), (2, 1)):
        step = F.softplus(dt[b])[:, None]
        want = torch.exp(step * A) * before[line] + step * x[b][:, None] * B[b][None, :]
        torch.testing.assert_close(state[line], want)
        expect = ((want * C[b]).sum(-1) + D * x[b]) * F.silu(z[b])
        torch.testing.assert_close(y[b], expect)
    assert torch.equal(y[1], torch.zeros(dim)), "a padded request's output is written"
    torch.testing.assert_close(state[[0, 2, 3]], before[[0, 2, 3]], atol=0, rtol=0)


def test_state_update_writes_to_destination_rows_of_a_strided_view():
    """dst_state_batch_indices: read row 1, write row 3; the view steps over padding."""
    pages = torch.zeros(5, 40)  # 5 blocks of 40 floats, the state is 2 x 3 x 4 = 24 of them
    view = torch.as_strided(pages, (5, 2, 3, 4), (40, 12, 4, 1))
    view[1] = 1.0
    x = torch.ones(1, 2, 3)
    zero_dt = torch.full((1, 2, 3), -30.0)  # softplus ~ 0: the state is carried over
    A, BC = -torch.ones(2, 3, 4), torch.ones(1, 1, 4)
    mamba.selective_state_update(
        view, x, zero_dt, A, BC, BC, dt_softplus=True,
        state_batch_indices=torch.tensor([1]), dst_state_batch_indices=torch.tensor([3]),
    )  # fmt: skip
    torch.testing.assert_close(view[3], torch.ones(2, 3, 4), atol=1e-6, rtol=0)
    assert pages[:, 24:].abs().sum() == 0, "page padding was written"


def test_bad_shapes_and_unsupported_features_are_errors():
    with pytest.raises(OpInputError, match="initial_states must be"):
        x, dt, A, B, C, *_ = _inputs(3, 5)
        mamba.mamba_chunk_scan_combined(
            x, dt, A, B, C, 4, initial_states=torch.zeros(1, 4, 3, 5),
            cu_seqlens=torch.tensor([0, 2, 5]),
        )  # fmt: skip
    with pytest.raises(ReferenceUnsupportedError, match="num_accepted_tokens"):
        mamba.selective_state_update(
            torch.zeros(1, 2, 3), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(2, 3),
            torch.zeros(1, 3), torch.zeros(1, 3), num_accepted_tokens=torch.tensor([1]),
        )  # fmt: skip
