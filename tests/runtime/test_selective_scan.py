"""The Mamba-1 selective scan against transformers' own mixers (their PyTorch paths).

A mixer's weights drive a packed, paged composition of the reference operators
(``causal_conv1d_fn`` then ``selective_scan_fn`` over ``query_start_loc``); its output must
equal the transformers mixer run on each request alone, and a prefill continued from the
paged states must equal one long prefill.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvskill.runtime.ops import fla
from kvskill.runtime.ops.reference._checks import OpInputError
from kvskill.runtime.ops.selective_scan import selective_scan_fn

DIM, DSTATE, KERNEL, RANK, HIDDEN = 8, 4, 4, 2, 6


def _mamba_mixer():
    from transformers import MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer

    config = MambaConfig(
        hidden_size=HIDDEN,
        intermediate_size=DIM,
        state_size=DSTATE,
        conv_kernel=KERNEL,
        time_step_rank=RANK,
        num_hidden_layers=1,
        use_mambapy=False,
    )
    return MambaMixer(config, layer_idx=0).eval()


def _jamba_mixer():
    from transformers import JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    config = JambaConfig(
        hidden_size=DIM // 2,
        mamba_expand=2,
        mamba_d_state=DSTATE,
        mamba_d_conv=KERNEL,
        mamba_dt_rank=RANK,
        num_hidden_layers=1,
        use_mamba_kernels=False,
    )
    return JambaMambaMixer(config, layer_idx=0).eval()


def _dt_b_c(mixer, x):
    """The selection of either mixer: x [T, dim] -> dt [T, dim] (before bias), B, C [T, N]."""
    dt, B, C = torch.split(
        mixer.x_proj(x), [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], -1
    )
    if hasattr(mixer, "dt_layernorm"):
        dt, B, C = mixer.dt_layernorm(dt), mixer.b_layernorm(B), mixer.c_layernorm(C)
    return dt @ mixer.dt_proj.weight.t(), B, C


def _paged_mixer(mixer, hidden, lens, conv_states, ssm_states, lines, has_init):
    """The mixer over packed requests (hidden [T, hidden]) on paged states."""
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x, gate = mixer.in_proj(hidden).t().chunk(2, dim=0)  # [dim, T]
    x = fla.causal_conv1d_fn(
        x.contiguous(),
        mixer.conv1d.weight.squeeze(1),
        mixer.conv1d.bias,
        conv_states,
        qsl,
        cache_indices=lines,
        has_initial_state=has_init,
        activation="silu",
    )
    dt, B, C = _dt_b_c(mixer, x.t())
    y = selective_scan_fn(
        x,
        ssm_states,
        dt.t().contiguous(),
        -torch.exp(mixer.A_log.float()),
        B.t(),
        C.t(),
        mixer.D.float(),
        gate.contiguous(),
        mixer.dt_proj.bias.float(),
        delta_softplus=True,
        query_start_loc=qsl,
        cache_indices=lines,
        has_initial_state=has_init,
    )
    return mixer.out_proj(y.t())


@pytest.fixture(params=["mamba", "jamba"], scope="module")
def mixer(request):
    torch.manual_seed(0)
    with torch.no_grad():
        mixer = {"mamba": _mamba_mixer, "jamba": _jamba_mixer}[request.param]()
        # random A and D, so a wrong decay or skip term cannot hide behind the init values
        mixer.A_log.copy_(torch.randn_like(mixer.A_log) * 0.5)
        mixer.D.copy_(torch.randn_like(mixer.D))
    return mixer


@torch.no_grad()
def test_packed_requests_equal_transformers_mixer_per_request(mixer):
    lens = [5, 1, 3]
    hidden = torch.randn(sum(lens), mixer.hidden_size)
    conv = torch.randn(6, DIM, KERNEL - 1)  # dirty lines: has_initial_state False must ignore
    ssm = torch.randn(6, DIM, DSTATE)
    lines = torch.tensor([4, 0, 2], dtype=torch.int32)
    out = _paged_mixer(mixer, hidden, lens, conv, ssm, lines, torch.zeros(3, dtype=torch.bool))
    start = 0
    for n in lens:
        want = mixer(hidden[start : start + n].unsqueeze(0))[0]
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n


@torch.no_grad()
def test_prefill_then_decode_equals_one_long_prefill(mixer):
    lens = [6, 4]
    hidden = torch.randn(sum(lens), mixer.hidden_size)
    lines = torch.tensor([1, 3], dtype=torch.int32)
    conv, ssm = torch.randn(4, DIM, KERNEL - 1), torch.randn(4, DIM, DSTATE)
    whole = _paged_mixer(
        mixer, hidden, lens, conv.clone(), ssm.clone(), lines, torch.zeros(2, dtype=torch.bool)
    )
    # the same requests in three steps: a prefix, a chunk, then one token each
    pieces = [[3, 2], [2, 1], [1, 1]]
    done = [0, 0]
    outs = [[], []]
    for step, part in enumerate(pieces):
        rows = torch.cat([hidden[sum(lens[:r]) + done[r] :][: part[r]] for r in range(2)])
        has_init = torch.tensor([step > 0] * 2)
        out = _paged_mixer(mixer, rows, part, conv, ssm, lines, has_init)
        outs[0].append(out[: part[0]])
        outs[1].append(out[part[0] :])
        done = [d + p for d, p in zip(done, part, strict=True)]
    torch.testing.assert_close(torch.cat(outs[0] + outs[1]), whole, atol=1e-5, rtol=1e-5)


def test_batched_form_and_groups_match_the_packed_form():
    torch.manual_seed(1)
    dim, dstate, groups, length = 4, 3, 2, 5
    u, delta, z = (torch.randn(2, dim, length) for _ in range(3))
    A = -torch.rand(dim, dstate)
    B, C = torch.randn(2, groups, dstate, length), torch.randn(2, groups, dstate, length)
    states = torch.zeros(2, dim, dstate)
    out = selective_scan_fn(u, states, delta, A, B, C, z=z.clone(), delta_softplus=True)
    packed_states = torch.zeros(2, dim, dstate)
    packed = selective_scan_fn(
        torch.cat(tuple(u), 1),
        packed_states,
        torch.cat(tuple(delta), 1),
        A,
        torch.cat(tuple(B), -1),
        torch.cat(tuple(C), -1),
        z=torch.cat(tuple(z), 1),
        delta_softplus=True,
        query_start_loc=torch.tensor([0, length, 2 * length]),
    )
    torch.testing.assert_close(torch.cat(tuple(out), 1), packed)
    torch.testing.assert_close(states, packed_states)
    # one naive step check: channel 3 reads group 1
    dt = F.softplus(delta[0, 3, 0])
    h = dt * B[0, 1, :, 0] * u[0, 3, 0]
    y = (h * C[0, 1, :, 0]).sum() * F.silu(z[0, 3, 0])
    torch.testing.assert_close(out[0, 3, 0], y)


def test_padded_request_is_skipped_and_its_state_untouched():
    u, delta = torch.randn(2, 4), torch.randn(2, 4)
    states = torch.randn(3, 2, 3)
    before = states.clone()
    out = selective_scan_fn(
        u,
        states,
        delta,
        -torch.rand(2, 3),
        torch.randn(3, 4),
        torch.randn(3, 4),
        z=torch.full((2, 4), 7.0),
        query_start_loc=torch.tensor([0, 2, 4]),
        cache_indices=torch.tensor([-1, 1]),
        has_initial_state=torch.tensor([True, True]),
    )
    assert torch.equal(out[:, :2], torch.full((2, 2), 7.0))
    assert torch.equal(states[0], before[0]) and torch.equal(states[2], before[2])
    assert not torch.equal(states[1], before[1])


def test_shapes_are_checked():
    with pytest.raises(OpInputError, match="ssm_states"):
        selective_scan_fn(
            torch.randn(2, 4),
            torch.zeros(1, 3, 3),
            torch.randn(2, 4),
            torch.zeros(2, 3),
            torch.randn(3, 4),
            torch.randn(3, 4),
            query_start_loc=torch.tensor([0, 4]),
        )
