"""FLA entry points on the NPU backend: the torch_npu operator computes what the entry point
promises, or the call stays on the reference with a reason.

The reference torch_npu stands in for the device module, so each routed call runs the
operator's reference (token-major layouts, value-major delta-rule state) and its result is
compared with the FLA reference on copies of the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime import ops
from kvskill.runtime.ops import fla, fla_npu, fla_reference

BF16 = torch.bfloat16
#: bf16 rounding: the routes round where the FLA reference keeps fp32 (q/k after the L2
#: norm, the conv output before bias and activation); a layout or index error is O(1)
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


@pytest.fixture
def npu_backend(monkeypatch):
    monkeypatch.setattr(ops, "torch_npu", ops.reference)
    monkeypatch.setattr(ops, "_BACKEND", ops.Backend("npu", "the reference stands in"))
    fla_npu._device_name.cache_clear()
    fla.reset_dispatch_report()
    yield
    fla.reset_dispatch_report()


def _served(entry: str) -> list[tuple[str, str]]:
    return [(r["backend"], r["via"]) for r in fla.dispatch_report() if r["entry"] == entry]


def _conv_inputs(width=3, dim=128, lens=(5, 1, 7), dtype=BF16, lines=(4, 0, 2)):
    torch.manual_seed(0)
    x = torch.randn(dim, sum(lens), dtype=dtype)
    weight = torch.randn(dim, width, dtype=dtype) / width
    bias = torch.randn(dim, dtype=dtype)
    states = torch.randn(6, width - 1, dim, dtype=dtype).transpose(-1, -2)  # as the runtime
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, weight, bias, states, qsl, torch.tensor(lines, dtype=torch.int32)


def test_reference_backend_counts_every_call_as_reference():
    fla.reset_dispatch_report()
    x, weight, bias, states, qsl, lines = _conv_inputs(dtype=torch.float32)
    fla.causal_conv1d_fn(x, weight, bias, states, qsl, cache_indices=lines)
    fla.causal_conv1d_fn(x, weight, bias, states, qsl, cache_indices=lines)
    assert fla.dispatch_report() == [
        {
            "entry": "causal_conv1d_fn",
            "backend": "reference",
            "via": fla.REFERENCE_BACKEND,
            "calls": 2,
        }
    ]
    fla.reset_dispatch_report()


@pytest.mark.parametrize("activation", [None, "silu"])
def test_prefill_conv_goes_to_the_fused_conv_and_matches(npu_backend, activation):
    x, weight, bias, states, qsl, lines = _conv_inputs()
    has_init = torch.tensor([True, False, True])
    want_states = states.clone()
    want = fla_reference.causal_conv1d_fn(
        x, weight, bias, want_states, qsl, lines, has_init, activation=activation
    )
    got = fla.causal_conv1d_fn(x, weight, bias, states, qsl, lines, has_init, activation)
    assert _served("causal_conv1d_fn") == [("npu", "torch_npu.npu_fused_causal_conv1d")]
    torch.testing.assert_close(got, want, **BF16_TOL)
    # the new request's row was zeroed first, then written: every row as the reference left it
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)


@pytest.mark.parametrize("form", ["token", "batch", "packed"])
def test_decode_conv_forms_match(npu_backend, form):
    _, weight, bias, states, _, lines = _conv_inputs()
    torch.manual_seed(1)
    qsl = None
    if form == "token":
        x = torch.randn(3, 128, dtype=BF16)
    elif form == "batch":
        x = torch.randn(3, 128, 2, dtype=BF16)
    else:
        x = torch.randn(4, 128, dtype=BF16)
        qsl = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    want_states = states.clone()
    want = fla_reference.causal_conv1d_update(
        x, want_states, weight, bias, "silu", lines, query_start_loc=qsl
    )
    got = fla.causal_conv1d_update(x, states, weight, bias, "silu", lines, query_start_loc=qsl)
    assert _served("causal_conv1d_update") == [("npu", "torch_npu.npu_fused_causal_conv1d")]
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, **BF16_TOL)
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)


def _reason(entry: str) -> str:
    (row,) = [r for r in fla.dispatch_report() if r["entry"] == entry]
    assert row["backend"] == "reference"
    return row["via"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"width": 4}, "K=3"),  # the operator's kernel width is fixed at 3
        ({"dim": 96}, "dim % 128"),
        ({"dtype": torch.float32}, "float32"),
    ],
)
def test_conv_outside_the_operator_limits_stays_on_the_reference(npu_backend, change, reason):
    x, weight, bias, states, qsl, lines = _conv_inputs(**change)
    want_states = states.clone()
    want = fla_reference.causal_conv1d_fn(x, weight, bias, want_states, qsl, lines)
    got = fla.causal_conv1d_fn(x, weight, bias, states, qsl, lines)
    assert reason in _reason("causal_conv1d_fn")
    assert torch.equal(got, want) and torch.equal(states, want_states)


def test_conv_on_a_device_the_operator_does_not_list(npu_backend, monkeypatch):
    monkeypatch.setattr(fla_npu, "_device_name", lambda: "Ascend910B3")
    x, weight, bias, states, qsl, lines = _conv_inputs()
    fla.causal_conv1d_fn(x, weight, bias, states, qsl, lines)
    assert "Ascend 950 only" in _reason("causal_conv1d_fn")


def test_decode_conv_with_a_longer_state_row_stays_on_the_reference(npu_backend):
    _, weight, bias, _, _, lines = _conv_inputs()
    states = torch.randn(6, 128, 4, dtype=BF16)  # K - 1 = 2 columns would agree; 4 do not
    fla.causal_conv1d_update(torch.randn(3, 128, dtype=BF16), states, weight, bias, None, lines)
    assert "K-1 = 2" in _reason("causal_conv1d_update")


def test_verify_step_conv_with_a_line_per_token_stays_on_the_reference(npu_backend):
    # the operator takes one cache line per request; a verify step names one per token
    _, weight, bias, states, _, _ = _conv_inputs()
    lines = torch.tensor([[4, 5, 1], [0, -1, -1]], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    x = torch.randn(4, 128, dtype=BF16)
    fla.causal_conv1d_update(x, states, weight, bias, None, lines, query_start_loc=qsl)
    assert "a line per token" in _reason("causal_conv1d_update")


def _delta_inputs(lens, *, heads=2, value_heads=4, dk=128, dv=128, dtype=BF16, slots=8):
    torch.manual_seed(2)
    total = sum(lens)
    q = torch.randn(1, total, heads, dk, dtype=dtype)
    k = torch.randn(1, total, heads, dk, dtype=dtype)
    v = torch.randn(1, total, value_heads, dv, dtype=dtype)
    g = -torch.rand(1, total, value_heads) * 0.5
    beta = torch.rand(1, total, value_heads, dtype=dtype)
    state = torch.randn(slots, value_heads, dk, dv, dtype=dtype) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, state, cu


def test_decode_delta_rule_goes_to_the_recurrent_operator_and_matches(npu_backend):
    q, k, v, g, beta, state, cu = _delta_inputs([1, 1, 1])
    rows = torch.tensor([5, 0, 3])
    want_state = state.clone()
    kwargs = {"cu_seqlens": cu, "ssm_state_indices": rows, "use_qk_l2norm_in_kernel": True}
    want, _ = fla_reference.fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=want_state, **kwargs
    )
    got, returned = fla.recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, **kwargs
    )
    assert _served("fused_recurrent_gated_delta_rule") == [
        ("npu", "torch_npu.npu_recurrent_gated_delta_rule")
    ]
    assert returned is state and got.shape == want.shape
    torch.testing.assert_close(got, want, **BF16_TOL)
    torch.testing.assert_close(state, want_state, **BF16_TOL)
    untouched = [1, 2, 4, 6, 7]
    assert torch.equal(state[untouched], want_state[untouched])


def test_delta_rule_outside_the_operator_limits_stays_on_the_reference(npu_backend):
    q, k, v, g, beta, state, cu = _delta_inputs([9, 1])  # L_i <= 8
    fla.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, cu_seqlens=cu)
    assert "L_i <= 8" in _reason("fused_recurrent_gated_delta_rule")
    fla.reset_dispatch_report()
    q, k, v, g, beta, state, cu = _delta_inputs([1, 1], dtype=torch.float32)
    fla.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, cu_seqlens=cu)
    assert "bfloat16" in _reason("fused_recurrent_gated_delta_rule")


def test_prefill_delta_rule_goes_to_the_chunk_operator_and_matches(npu_backend):
    q, k, v, g, beta, state, cu = _delta_inputs([6, 3, 11])
    start = state[:3].float()  # the converted prefill gathers fp32 copies of bf16 rows
    kwargs = {"cu_seqlens": cu, "use_qk_l2norm_in_kernel": True, "output_final_state": True}
    want, want_final = fla_reference.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=start, **kwargs
    )
    got, final = fla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=start, **kwargs)
    assert _served("chunk_gated_delta_rule") == [("npu", "torch_npu.npu_chunk_gated_delta_rule")]
    torch.testing.assert_close(got, want, **BF16_TOL)
    assert final.shape == want_final.shape
    torch.testing.assert_close(final.float(), want_final.float(), **BF16_TOL)


def test_prefill_delta_rule_with_head_dim_64_stays_on_the_reference(npu_backend):
    q, k, v, g, beta, _, cu = _delta_inputs([4, 4], dk=64, dv=64)
    fla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    assert "Dk = Dv = 128" in _reason("chunk_gated_delta_rule")


def test_entry_points_without_an_operator_say_why(npu_backend):
    q, k, v, _, beta, state, cu = _delta_inputs([1, 1])
    gk = -torch.rand(*v.shape[:3], q.size(-1))
    fla.fused_recurrent_kda(q, k, v, gk, beta, initial_state=state, cu_seqlens=cu)
    fla.chunk_kda(q, k, v, gk, beta, cu_seqlens=cu)
    assert "暂不支持" in _reason("fused_recurrent_kda")
    assert "per key channel" in _reason("chunk_kda")
    assert fla.dispatch_lines(fla.dispatch_report())[0].startswith("chunk_kda -> reference (")
