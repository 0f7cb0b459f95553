"""The gated delta rule recurrence and torch_npu.npu_recurrent_gated_delta_rule.

State orientation: the scan keeps FLA's key-major ``[..., HV, K, V]``; the torch_npu operator
stores ``[..., Nv, Dv, Dk]`` (the transpose of the last two axes), converted at its boundary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._checks import OpInputError, describe, strict_keywords
from .gated_delta_limits import check_chunk, check_recurrent

#: per-request token limit of npu_recurrent_gated_delta_rule (npu_ops.md §5.5)
MAX_TOKENS_PER_REQUEST = 8


def gated_delta_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    h0: Tensor,
    lens: Tensor,
    on_step: Callable[[int, Tensor, Tensor], None] | None = None,
) -> tuple[Tensor, Tensor]:
    """The gated delta recurrence over padded sequences, all in fp32.

    Shapes: q, k [N, T, HV, K] (already expanded to value heads and scaled), v [N, T, HV, V],
    g [N, T, HV] log-decay per head or [N, T, HV, K] per key channel (None = no decay),
    beta [N, T, HV] or [N, T, HV, V], h0 [N, HV, K, V] (key-major), lens [N]. Per token of a
    live sequence:

        h <- h * exp(g_t);  u = beta_t * (v_t - h^T k_t);  h <- h + k_t u^T;  o_t = h^T q_t

    Rows past a sequence's length keep their state. ``on_step(t, h, live)`` sees the state
    after token t. Returns (o [N, T, HV, V] fp32, h_final [N, HV, K, V] fp32).
    """
    n, t_max = q.shape[:2]
    h = h0.float().clone()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for t in range(t_max):
        live = (lens > t).view(n, 1, 1, 1)
        h_new = h
        if g is not None:
            decay = torch.exp(g[:, t].float())
            h_new = h * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        kt, vt = k[:, t].float(), v[:, t].float()
        pred = torch.einsum("nhkv,nhk->nhv", h_new, kt)
        bt = beta[:, t].float()
        u = (vt - pred) * (bt if bt.dim() == vt.dim() else bt[..., None])
        h_new = h_new + kt[..., None] * u[..., None, :]
        out[:, t] = torch.einsum("nhkv,nhk->nhv", h_new, q[:, t].float())
        h = torch.where(live, h_new, h)
        if on_step is not None:
            on_step(t, h, live)
    return out, h


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _as_list(name: str, t: Tensor | None) -> list[int] | None:
    if t is None:
        return None
    if not isinstance(t, Tensor) or t.is_floating_point() or t.dim() != 1:
        raise OpInputError(
            f"npu_recurrent_gated_delta_rule: `{name}` must be a 1-D int32 tensor, got "
            f"{describe(t)}"
        )
    return [int(x) for x in t.tolist()]


@strict_keywords("npu_recurrent_gated_delta_rule", {})
def npu_recurrent_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    state: Tensor,
    *,
    beta: Tensor | None = None,
    scale: float | None = None,
    actual_seq_lengths: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    g: Tensor | None = None,
    gk: Tensor | None = None,
) -> Tensor:
    """Gated delta rule for decode / speculative decode; ``state`` is updated in place.

    Args:
        query, key: [T, Nk, Dk] (the caller L2-normalises them); value: [T, Nv, Dv].
        state: [num_slots, Nv, Dv, Dk] (value-major).
        beta: [T, Nv] (default 1); g: [T, Nv] log decay; gk: [T, Nv, Dk] per-key log decay.
        scale: default Dk ** -0.5.
        actual_seq_lengths: int tensor [B] per-request token counts, 1..8 (default: one token
            per request). Not cumulative.
        ssm_state_indices: int tensor [T], the state slot of every token (default: token t uses
            slot t). Request i starts from slot ``idx[start_i + num_accepted_tokens[i] - 1]``
            (or ``idx[start_i]``) and the state after token t is stored to ``idx[t]``.

    Returns:
        out [T, Nv, Dv] in the query dtype.
    """
    out, _ = _recurrent(
        query,
        key,
        value,
        state,
        beta,
        scale,
        actual_seq_lengths,
        ssm_state_indices,
        num_accepted_tokens,
        g,
        gk,
    )
    return out


@strict_keywords("npu_recurrent_gated_delta_rule_functional", {})
def npu_recurrent_gated_delta_rule_functional(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    state: Tensor,
    *,
    beta: Tensor | None = None,
    scale: float | None = None,
    actual_seq_lengths: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    g: Tensor | None = None,
    gk: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Out-of-place twin: returns (out, updated copy of state)."""
    new_state = state.clone()
    out, _ = _recurrent(
        query,
        key,
        value,
        new_state,
        beta,
        scale,
        actual_seq_lengths,
        ssm_state_indices,
        num_accepted_tokens,
        g,
        gk,
    )
    return out, new_state


def _recurrent(query, key, value, state, beta, scale, lens_t, idx_t, acc_t, g, gk):
    op = "npu_recurrent_gated_delta_rule"
    t_total, nk, dk = query.shape
    nv, dv = value.size(1), value.size(2)
    if nv % nk or state.dim() != 4 or tuple(state.shape[1:]) != (nv, dv, dk):
        raise OpInputError(
            f"{op}: need Nv % Nk == 0 and state [slots, {nv}, {dv}, {dk}]; got query "
            f"{describe(query)}, value {describe(value)}, state {describe(state)}"
        )
    if g is not None and gk is not None:
        raise OpInputError(f"{op}: pass `g` or `gk`, not both")
    check_recurrent(
        op,
        query,
        value,
        key=key,
        state=state,
        beta=beta,
        g=g,
        actual_seq_lengths=lens_t,
        ssm_state_indices=idx_t,
        num_accepted_tokens=acc_t,
    )
    lens = _as_list("actual_seq_lengths", lens_t) or [1] * t_total
    if sum(lens) != t_total or any(not 1 <= n <= MAX_TOKENS_PER_REQUEST for n in lens):
        raise OpInputError(
            f"{op}: actual_seq_lengths must be per-request counts in 1..{MAX_TOKENS_PER_REQUEST} "
            f"summing to T = {t_total}, got {lens[:8]}"
        )
    slots = _as_list("ssm_state_indices", idx_t) or list(range(t_total))
    accepted = _as_list("num_accepted_tokens", acc_t)
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0).tolist()
    first = [s + ((accepted[i] - 1) if accepted else 0) for i, s in enumerate(starts)]
    offsets = [*starts, t_total]
    idx, valid = pad_index(offsets, query.device)
    group = nv // nk
    scale = dk**-0.5 if scale is None else scale
    qp = query[idx].float().repeat_interleave(group, dim=2) * scale
    kp = key[idx].float().repeat_interleave(group, dim=2)
    vp = value[idx]
    bp = beta[idx] if beta is not None else torch.ones(vp.shape[:3], device=value.device)
    decay = g if g is not None else gk
    dp = decay[idx] if decay is not None else None
    slot_t = torch.tensor(slots, dtype=torch.long, device=state.device)
    h0 = state[slot_t[first]].transpose(-1, -2)  # [B, Nv, Dk, Dv]
    slot_pad = slot_t[idx]  # [B, Tmax]

    def store(t: int, h: Tensor, live: Tensor) -> None:
        ok = live.view(-1)
        state[slot_pad[ok, t]] = h[ok].transpose(-1, -2).to(state.dtype)

    out, h_final = gated_delta_scan(
        qp, kp, vp, dp, bp, h0, torch.tensor(lens, device=query.device), on_step=store
    )
    return out[valid].to(query.dtype), h_final


def pad_index(offsets: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Index [N, max_len] into packed rows for cumulative ``offsets`` (from 0) + valid mask."""
    lens = torch.tensor([b - a for a, b in zip(offsets, offsets[1:], strict=False)], device=device)
    width = int(lens.max()) if lens.numel() else 0
    pos = torch.arange(width, device=device).view(1, -1)
    start = torch.tensor(offsets[:-1], device=device).view(-1, 1)
    valid = pos < lens.view(-1, 1)
    return torch.where(valid, start + pos, torch.zeros_like(pos)), valid


@strict_keywords("npu_chunk_gated_delta_rule", {})
def npu_chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    beta: Tensor | None = None,
    initial_state: Tensor | None = None,
    actual_seq_lengths: Tensor | None = None,
    scale: float | None = None,
    g: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over packed prefill sequences (TND), state in and out by request.

    Args:
        query, key: [T, Nk, Dk] (the caller L2-normalises them); value: [T, Nv, Dv].
        beta: [T, Nv]; g: [T, Nv] log decay (default none).
        initial_state: [B, Nv, Dv, Dk] (value-major); default zeros.
        actual_seq_lengths: int tensor [B], per-request token counts (not cumulative).
        scale: default **1.0** here (unlike FLA's K ** -0.5).

    Returns:
        (out [T, Nv, Dv] in the query dtype, final_state [B, Nv, Dv, Dk]). The reference
        evaluates the recurrence token by token; the chunked device kernel computes the same
        values up to rounding.
    """
    op = "npu_chunk_gated_delta_rule"
    t_total, nk, dk = query.shape
    nv, dv = value.size(1), value.size(2)
    if nv % nk:
        raise OpInputError(f"{op}: value heads {nv} must be a multiple of key heads {nk}")
    check_chunk(
        op,
        query,
        value,
        key=key,
        beta=beta,
        initial_state=initial_state,
        g=g,
        actual_seq_lengths=actual_seq_lengths,
    )
    lens = _as_list("actual_seq_lengths", actual_seq_lengths) or [t_total]
    if sum(lens) != t_total or min(lens) < 0:
        raise OpInputError(
            f"{op}: actual_seq_lengths must be per-request counts summing to T = {t_total}, "
            f"got {lens[:8]}"
        )
    batch = len(lens)
    if initial_state is not None and tuple(initial_state.shape) != (batch, nv, dv, dk):
        raise OpInputError(
            f"{op}: initial_state must be [{batch}, {nv}, {dv}, {dk}], got {describe(initial_state)}"
        )
    offsets = torch.tensor([0, *lens]).cumsum(0).tolist()
    idx, valid = pad_index(offsets, query.device)
    group = nv // nk
    scale = 1.0 if scale is None else scale
    qp = query[idx].float().repeat_interleave(group, dim=2) * scale
    kp = key[idx].float().repeat_interleave(group, dim=2)
    vp = value[idx]
    bp = beta[idx] if beta is not None else torch.ones(vp.shape[:3], device=value.device)
    dp = g[idx] if g is not None else None
    if initial_state is None:
        h0 = torch.zeros(batch, nv, dk, dv, device=query.device)
    else:
        h0 = initial_state.transpose(-1, -2)
    out, h_final = gated_delta_scan(qp, kp, vp, dp, bp, h0, torch.tensor(lens, device=query.device))
    state_dtype = initial_state.dtype if initial_state is not None else query.dtype
    return out[valid].to(query.dtype), h_final.transpose(-1, -2).to(state_dtype)
