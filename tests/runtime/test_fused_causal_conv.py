"""torch_npu.npu_fused_causal_conv1d (reference) against transformers' LFM2 short conv.

The short conv's weights drive a packed, paged composition of the operator (the emitted
code's: zero a new request's row, conv, add the bias); it must equal transformers'
``Lfm2ShortConv`` run on each request alone, and a prefill continued from the paged states
must equal one long prefill.
"""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import npu_limits
from kvskill.runtime.ops.reference import OpInputError, npu_fused_causal_conv1d

HIDDEN, KERNEL = 8, 3


@pytest.fixture(scope="module")
def short_conv():
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    torch.manual_seed(0)
    config = Lfm2Config(
        hidden_size=HIDDEN,
        conv_L_cache=KERNEL,
        conv_bias=True,
        num_hidden_layers=1,
        layer_types=["conv"],
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return Lfm2ShortConv(config, layer_idx=0).eval()


def _paged(conv, hidden, lens, states, lines, has_init):
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    states[lines[~has_init].long()] = 0
    B, C, x = conv.in_proj(hidden).chunk(3, dim=-1)  # token-major [T, hidden]
    y = npu_fused_causal_conv1d(
        (B * x).contiguous(),
        conv.conv.weight.squeeze(1).t().contiguous(),
        states,
        query_start_loc=qsl,
        cache_indices=lines,
    )
    return conv.out_proj(C * (y + conv.conv.bias))


@torch.no_grad()
def test_packed_requests_equal_transformers_short_conv_per_request(short_conv):
    lens = [4, 1, 6]
    hidden = torch.randn(sum(lens), HIDDEN)
    states = torch.randn(5, KERNEL - 1, HIDDEN)  # dirty rows, zeroed for the new requests
    lines = torch.tensor([3, 0, 4], dtype=torch.int32)
    out = _paged(short_conv, hidden, lens, states, lines, torch.zeros(3, dtype=torch.bool))
    start = 0
    for n in lens:
        want = short_conv(hidden[start : start + n].unsqueeze(0))[0]
        torch.testing.assert_close(out[start : start + n], want, atol=1e-6, rtol=1e-5)
        start += n
    # each line holds its request's last K-1 inputs
    B, _, x = short_conv.in_proj(hidden[-2:]).chunk(3, dim=-1)
    torch.testing.assert_close(states[4], B * x)


@torch.no_grad()
def test_prefill_then_decode_equals_one_long_prefill(short_conv):
    lens = [5, 3]
    hidden = torch.randn(sum(lens), HIDDEN)
    lines = torch.tensor([2, 0], dtype=torch.int32)
    fresh = torch.zeros(2, dtype=torch.bool)
    whole = _paged(short_conv, hidden, lens, torch.randn(3, KERNEL - 1, HIDDEN), lines, fresh)
    states = torch.randn(3, KERNEL - 1, HIDDEN)
    done, outs = [0, 0], [[], []]
    for step, part in enumerate([[2, 1], [2, 1], [1, 1]]):  # chunks, then decode
        rows = torch.cat([hidden[sum(lens[:r]) + done[r] :][: part[r]] for r in range(2)])
        out = _paged(short_conv, rows, part, states, lines, torch.tensor([step > 0] * 2))
        outs[0].append(out[: part[0]])
        outs[1].append(out[part[0] :])
        done = [d + p for d, p in zip(done, part, strict=True)]
    torch.testing.assert_close(torch.cat(outs[0] + outs[1]), whole, atol=1e-6, rtol=1e-5)


def test_residual_batch_form_and_pad_slot():
    x = torch.randn(2, 3, 4)
    weight = torch.randn(KERNEL, 4)
    states = torch.zeros(3, KERNEL - 1, 4)
    y = npu_fused_causal_conv1d(
        x, weight, states, cache_indices=torch.tensor([-1, 2]), residual_connection=1
    )
    assert torch.equal(y[0], torch.zeros(3, 4))  # padded sequence: skipped
    assert torch.equal(states[0], torch.zeros(KERNEL - 1, 4))
    want0 = weight[-1] * x[1, 0] + x[1, 0]  # first token: zero history, plus the residual
    torch.testing.assert_close(y[1, 0], want0)
    torch.testing.assert_close(states[2], x[1, 1:])


def test_unsupported_arguments_and_npu_limits_are_refused():
    x, weight = torch.randn(3, 4), torch.randn(KERNEL, 4)
    states, qsl = torch.zeros(1, KERNEL - 1, 4), torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(OpInputError, match="`bias` is not supported"):
        npu_fused_causal_conv1d(x, weight, states, query_start_loc=qsl, bias=torch.zeros(4))
    with pytest.raises(OpInputError, match="`activation`"):
        npu_fused_causal_conv1d(x, weight, states, query_start_loc=qsl, activation="silu")
    with pytest.raises(TypeError, match="cache_indices"):
        npu_fused_causal_conv1d(x, weight, states, query_start_loc=qsl, conv_state_indices=None)
    with pytest.raises(OpInputError, match="needs query_start_loc"):
        npu_fused_causal_conv1d(x, weight, states)
    with npu_limits(), pytest.raises(OpInputError, match="dim % 128"):
        npu_fused_causal_conv1d(x, weight, states, query_start_loc=qsl)
