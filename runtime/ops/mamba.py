"""Reference Mamba (selective state space) operators, in plain PyTorch, with vLLM's signatures.

torch_npu has no Mamba operator, so the names and keywords are vLLM's
(``vllm.model_executor.layers.mamba.ops``): ``selective_state_update`` for decode (one token
per request, Mamba-1 ``[B, dim, dstate]`` and Mamba-2 ``[B, nheads, headdim, dstate]`` states)
and ``mamba_chunk_scan_combined`` for prefill (the SSD chunked scan of Mamba-2, packed
sequences with ``cu_seqlens`` and one initial state per sequence). The causal convolution the
mixers run before the scan is ``fla.causal_conv1d_fn`` / ``fla.causal_conv1d_update``.

The recurrence both operators compute, per head h, channel p and state n (fp32):

    dt_t  = softplus(dt_t + dt_bias)            (when dt_softplus), clamped to dt_limit
    s_t   = exp(dt_t * A) * s_{t-1} + dt_t * B_t * x_t
    y_t   = sum_n C_t[n] * s_t[n] + D * x_t,    then y_t *= silu(z_t) when z is given

B and C are shared by the ``nheads // ngroups`` heads of a group. State rows of a paged
cache are addressed by ``state_batch_indices``; rows equal to ``pad_slot_id`` are skipped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference._checks import OpInputError, describe, reject_if_used
from .reference.graph_ops import compiling, register

PAD_SLOT_ID = -1
#: dt_limit meaning "no clamp"
NO_DT_LIMIT = (0.0, float("inf"))


def _discretise_dt(
    dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_DT_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _per_head(t: Tensor, nheads: int, what: str) -> Tensor:
    """[..., ngroups, dstate] -> [..., nheads, dstate] (each group serves nheads // ngroups)."""
    groups = t.size(-2)
    if nheads % groups:
        raise OpInputError(f"{what}: nheads {nheads} is not a multiple of ngroups {groups}")
    return t.repeat_interleave(nheads // groups, dim=-2)


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: Tensor | None = None,
    dst_state_batch_indices: Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    out: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """One decode step of the selective scan; the state rows are updated in place.

    Args:
        state: Mamba-1 ``[num_lines, dim, dstate]`` or Mamba-2 ``[num_lines, nheads, dim,
            dstate]`` (any strides, e.g. a page-pool view).
        x, dt, z: ``[B, dim]`` or ``[B, nheads, dim]``.
        A: ``[dim, dstate]`` or ``[nheads, dim, dstate]``.
        B, C: ``[B, dstate]`` or ``[B, ngroups, dstate]``.
        D, dt_bias: ``[dim]`` or ``[nheads, dim]``.
        state_batch_indices: ``[B]`` state line of each request (default: line b);
            ``pad_slot_id`` skips the request (its output row is left as is).
        dst_state_batch_indices: ``[B]`` line the new state goes to (default: the source).
        out: preallocated output shaped like x, written in place.

    Returns:
        the output (``out`` when given), shaped like x, in x's dtype.
    """
    reject_if_used(
        "selective_state_update",
        num_accepted_tokens=num_accepted_tokens,
        cu_seqlens=cu_seqlens,
    )
    if out is None and compiling():
        # a step being compiled: one registered operator that writes the state rows
        return _STATE_UPDATE_OP(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
            dst_state_batch_indices, pad_slot_id,
        )  # fmt: skip
    return _state_update(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
        dst_state_batch_indices, pad_slot_id, out,
    )  # fmt: skip


def _state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    state_batch_indices: Tensor | None,
    dst_state_batch_indices: Tensor | None,
    pad_slot_id: int,
    out: Tensor | None = None,
) -> Tensor:
    """selective_state_update's checks and math (the registered operator's body)."""
    mamba1 = state.dim() == 3
    if state.dim() not in (3, 4):
        raise OpInputError(
            "selective_state_update: state must be [lines, dim, dstate] or "
            f"[lines, nheads, dim, dstate], got {describe(state)}"
        )
    if mamba1:  # one head holding every channel
        x, dt, A = x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0)
        B, C = B.unsqueeze(1), C.unsqueeze(1)
        z = z.unsqueeze(1) if z is not None else None
        D = D.unsqueeze(0) if D is not None else None
        dt_bias = dt_bias.unsqueeze(0) if dt_bias is not None else None
    batch, nheads, dim = x.shape
    dstate = state.size(-1)
    lines_view = state.unsqueeze(1) if mamba1 else state
    if tuple(lines_view.shape[1:]) != (nheads, dim, dstate) or tuple(A.shape) != (
        nheads,
        dim,
        dstate,
    ):
        raise OpInputError(
            f"selective_state_update: state {describe(state)} and A {describe(A)} do not match "
            f"x {describe(x)} and dstate {dstate}"
        )
    if out is not None and out.shape != (x.squeeze(1) if mamba1 else x).shape:
        raise OpInputError(
            f"selective_state_update: out must be shaped like x, got {describe(out)}"
        )
    src = (
        state_batch_indices.to(torch.int64).view(-1)
        if state_batch_indices is not None
        else torch.arange(batch, device=x.device)
    )
    dst = (
        dst_state_batch_indices.to(torch.int64).view(-1)
        if dst_state_batch_indices is not None
        else src
    )
    live = (src != pad_slot_id) & (dst != pad_slot_id)
    s = lines_view.index_select(0, torch.where(live, src, torch.zeros_like(src))).float()
    step = _discretise_dt(dt, dt_bias, dt_softplus, NO_DT_LIMIT)  # [B, H, P]
    b_h = _per_head(B.float(), nheads, "selective_state_update")[:, :, None, :]  # [B,H,1,N]
    c_h = _per_head(C.float(), nheads, "selective_state_update")[:, :, None, :]
    xf = x.float()
    s = torch.exp(step[..., None] * A.float()) * s + (step * xf)[..., None] * b_h
    y = (s * c_h).sum(-1)
    if D is not None:
        y = y + xf * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    if bool(live.any()):
        rows = dst[live]
        lines_view.index_copy_(0, rows, s[live].to(state.dtype))
    result = y.to(x.dtype)
    if mamba1:
        result = result.squeeze(1)
    if out is None:
        out = torch.zeros_like(result)
    out[live] = result[live]
    return out


def _state_update_fake(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    state_batch_indices: Tensor | None,
    dst_state_batch_indices: Tensor | None,
    pad_slot_id: int,
    out: Tensor | None = None,
) -> Tensor:
    return torch.empty_like(x)  # shaped like x, in x's dtype


#: kvskill::selective_state_update_, which writes the state rows (no ``out``: a registered
#: operator returns fresh tensors)
_STATE_UPDATE_OP = register(
    "selective_state_update_", _state_update, _state_update_fake, mutates_args=("state",)
)


def _sequences(
    batch: int, seqlen: int, cu_seqlens: Tensor | None, seq_idx: Tensor | None
) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence: rows, or packed ones in row 0."""
    if cu_seqlens is None and seq_idx is not None:
        ids = seq_idx.view(batch, seqlen)[0].tolist()
        bounds = [0, *[t for t in range(1, seqlen) if ids[t] != ids[t - 1]], seqlen]
        return [(0, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    if cu_seqlens is None:
        return [(b, 0, seqlen) for b in range(batch)]
    starts = [int(c) for c in cu_seqlens.tolist()]
    if batch != 1 or starts[0] != 0 or starts[-1] != seqlen:
        raise OpInputError(
            f"mamba_chunk_scan_combined: cu_seqlens {starts[:9]} must run from 0 to {seqlen} "
            f"over a batch of 1 (packed), got batch {batch}"
        )
    if any(b < a for a, b in zip(starts, starts[1:], strict=False)):
        raise OpInputError(f"mamba_chunk_scan_combined: cu_seqlens not sorted: {starts[:9]}")
    return [(0, a, b) for a, b in zip(starts, starts[1:], strict=False)]


def _ssd_scan(xdt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor, chunk: int):
    """The SSD chunked scan over padded sequences, fp32.

    Shapes: xdt (x * dt) [S, T, H, P], a (dt * A) [S, T, H], b, c [S, T, H, N], h0
    [S, H, P, N], T a multiple of ``chunk``; padded tokens carry a = 0 and xdt = 0 so they
    neither decay nor feed the state. Within a chunk the output is a masked quadratic form
    (the "diagonal blocks"); across chunks the state is carried by a loop over chunks.
    Returns (y [S, T, H, P], final state [S, H, P, N]).
    """
    s, t, h, p = xdt.shape
    n = b.size(-1)
    k = t // chunk
    xdt, a = xdt.view(s, k, chunk, h, p), a.view(s, k, chunk, h)
    b, c = b.view(s, k, chunk, h, n), c.view(s, k, chunk, h, n)
    cum = a.cumsum(dim=2)  # [S, K, Q, H]
    # decay from token m to token l (m <= l) inside a chunk: exp(sum_{m < r <= l} a_r)
    grid = a.permute(0, 1, 3, 2)[..., :, None].expand(s, k, h, chunk, chunk)  # [..., r, m] = a_r
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).tril(-1)  # r > m
    seg = grid.masked_fill(~lower, 0).cumsum(dim=-2)  # [..., l, m] = sum_{m < r <= l} a_r
    seg = seg.masked_fill(~torch.ones_like(lower).tril(), -math.inf)
    decay = torch.exp(seg)  # [S, K, H, l, m]
    scores = torch.einsum("sklhn,skmhn->skhlm", c, b) * decay
    y = torch.einsum("skhlm,skmhp->sklhp", scores, xdt)
    # each chunk's contribution to the state at its end
    to_end = torch.exp(cum[:, :, -1:, :] - cum)  # [S, K, Q, H]
    chunk_states = torch.einsum("skqhn,skqh,skqhp->skhpn", b, to_end, xdt)
    state = h0.float()
    for j in range(k):
        # tokens of chunk j see the state entering it, decayed up to each token
        y[:, j] += torch.einsum("sqhn,shpn,sqh->sqhp", c[:, j], state, torch.exp(cum[:, j]))
        state = torch.exp(cum[:, j, -1])[..., None, None] * state + chunk_states[:, j]
    return y.reshape(s, t, h, p), state


def mamba_chunk_scan_combined(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    chunk_offsets: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_DT_LIMIT,
    out: Tensor | None = None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
):
    """The Mamba-2 SSD scan over whole sequences (prefill), packed or batched.

    Args:
        x: ``[batch, seqlen, nheads, headdim]``; dt: ``[batch, seqlen, nheads]``; A: ``[nheads]``.
        B, C: ``[batch, seqlen, ngroups, dstate]``.
        chunk_size: tokens per chunk of the scan (the result does not depend on it beyond
            rounding).
        D: ``[nheads]`` or ``[nheads, headdim]``; z: like x; dt_bias: ``[nheads]``.
        initial_states: ``[num_sequences, nheads, headdim, dstate]``, one per sequence
            (a batch row, or a packed sequence of ``cu_seqlens``); None = zeros.
        seq_idx: ``[batch, seqlen]`` sequence id of each packed token (read only when
            ``cu_seqlens`` is not given; then the two must agree).
        cu_seqlens: ``[num_sequences + 1]`` cumulative lengths from 0 over a batch of 1.
        dt_limit: clamp of dt after softplus.
        out: preallocated output shaped like x.
        return_final_states: also return the state after the last token of the last sequence
            of each row (``[batch, nheads, headdim, dstate]``).
        return_varlen_states: also return the final state of every sequence
            (``[num_sequences, nheads, headdim, dstate]``).
        state_dtype: dtype of the returned states (default fp32).

    Returns:
        out, or a tuple ``(out, final_states?, varlen_states?)`` as mamba_ssm returns it.
    """
    reject_if_used(
        "mamba_chunk_scan_combined", chunk_indices=chunk_indices, chunk_offsets=chunk_offsets
    )
    if x.dim() != 4 or dt.shape != x.shape[:3] or B.dim() != 4 or B.shape != C.shape:
        raise OpInputError(
            "mamba_chunk_scan_combined: expected x [b, L, H, P], dt [b, L, H], B/C [b, L, G, N]; "
            f"got x {describe(x)}, dt {describe(dt)}, B {describe(B)}, C {describe(C)}"
        )
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.size(-1)
    seqs = _sequences(batch, seqlen, cu_seqlens, seq_idx)
    if initial_states is not None and tuple(initial_states.shape) != (
        len(seqs),
        nheads,
        headdim,
        dstate,
    ):
        raise OpInputError(
            f"mamba_chunk_scan_combined: initial_states must be [{len(seqs)}, {nheads}, "
            f"{headdim}, {dstate}] (one per sequence), got {describe(initial_states)}"
        )
    lens = [e - a for _, a, e in seqs]
    width = max(1, -(-max(lens, default=1) // chunk_size)) * chunk_size
    # token index of every padded position of every sequence, and which are real
    pos = torch.arange(width, device=x.device)
    rows = torch.tensor([r for r, _, _ in seqs], device=x.device)
    starts = torch.tensor([a for _, a, _ in seqs], device=x.device)
    valid = pos[None, :] < torch.tensor(lens, device=x.device)[:, None]  # [S, W]
    take = torch.where(valid, starts[:, None] + pos[None, :], torch.zeros_like(pos[None, :]))

    def padded(t: Tensor) -> Tensor:
        got = t[rows[:, None], take].float()
        return got * valid.view(*valid.shape, *([1] * (got.dim() - 2)))

    step = _discretise_dt(padded(dt), dt_bias, dt_softplus, dt_limit) * valid[..., None]
    xs = padded(x)
    b = _per_head(padded(B), nheads, "mamba_chunk_scan_combined")
    c = _per_head(padded(C), nheads, "mamba_chunk_scan_combined")
    h0 = (
        initial_states.float()
        if initial_states is not None
        else x.new_zeros(len(seqs), nheads, headdim, dstate, dtype=torch.float32)
    )
    y, final = _ssd_scan(xs * step[..., None], step * A.float(), b, c, h0, chunk_size)
    if D is not None:
        y = y + xs * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(padded(z))
    result = out if out is not None else torch.zeros_like(x)
    result[rows[:, None].expand_as(take)[valid], take[valid]] = y[valid].to(result.dtype)
    state_dtype = state_dtype or torch.float32
    extras = []
    if return_final_states:
        last = {r: i for i, (r, _, _) in enumerate(seqs)}
        extras.append(final[[last[r] for r in range(batch)]].to(state_dtype))
    if return_varlen_states:
        extras.append(final.to(state_dtype))
    return (result, *extras) if extras else result


__all__ = [
    "PAD_SLOT_ID",
    "mamba_chunk_scan_combined",
    "selective_state_update",
]
