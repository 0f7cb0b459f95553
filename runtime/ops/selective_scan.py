"""Reference Mamba-1 selective scan over packed requests, with vLLM's name and signature.

torch_npu has no selective-scan operator (its schema file lists none), so the converted
Mamba-1 mixers call the form vLLM's ``mamba_ssm`` ops use: ``selective_scan_fn`` with the
request boundaries in ``query_start_loc`` and the state rows in ``cache_indices``. Per
channel ``d`` and state ``n`` of one request, with ``dt = softplus(delta + delta_bias)``:

    h_t[d, n] = exp(dt_t[d] * A[d, n]) * h_{t-1}[d, n] + dt_t[d] * B_t[g(d), n] * u_t[d]
    y_t[d]    = sum_n h_t[d, n] * C_t[g(d), n] + D[d] * u_t[d],   then y *= silu(z)

where ``h_0`` is the request's state row (zeros when it has no initial state) and the last
``h`` is written back to that row. Numerics accumulate in float32; the loop runs over time
steps with every request of the step in one batch (no per-request Python loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference._checks import OpInputError, describe, reject_if_used
from .reference.gated_delta import pad_index

PAD_SLOT_ID = -1


def _groups(x: Tensor, name: str, varlen: bool) -> Tensor:
    """B or C as [batch, groups, dstate, length] (batch 1 when packed)."""
    if varlen:
        if x.dim() == 2:  # [dstate, total]
            x = x.unsqueeze(0)
        if x.dim() != 3:
            raise OpInputError(
                f"selective_scan_fn: packed {name} must be [groups, dstate, total_tokens], "
                f"got {describe(x)}"
            )
        return x.unsqueeze(0)
    if x.dim() == 3:  # [batch, dstate, length]
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise OpInputError(
            f"selective_scan_fn: {name} must be [batch, groups, dstate, length], got {describe(x)}"
        )
    return x


def selective_scan_fn(
    u: Tensor,
    ssm_states: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    query_start_loc: Tensor | None = None,
    cache_indices: Tensor | None = None,
    has_initial_state: Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    block_size: int = 1024,
    block_idx_first_scheduled_token: Tensor | None = None,
    block_idx_last_scheduled_token: Tensor | None = None,
    initial_state_idx: Tensor | None = None,
) -> Tensor:
    """Selective scan of packed (``query_start_loc``) or batched sequences.

    Args:
        u, delta, z: [dim, total_tokens] packed, or [batch, dim, length].
        ssm_states: [lines, dim, dstate], any strides; read at and written back to the
            request's line in place.
        A: [dim, dstate]; D, delta_bias: [dim].
        B, C: [groups, dstate, total_tokens] (or [dstate, total_tokens]) packed, or
            [batch, groups, dstate, length] (or [batch, dstate, length]); channel d reads
            group ``d // (dim // groups)``.
        query_start_loc: [N + 1] cumulative offsets from 0 (packed form).
        cache_indices: [N] state line per sequence (default: line n); ``pad_slot_id`` =
            the sequence is skipped (its output is left as it was, its state untouched).
        has_initial_state: [N] bool; False (or the argument absent) starts from zeros.

    Returns:
        the output, shaped like u, written in place into ``z`` (or ``delta`` when z is None)
        as vLLM's kernel does.
    """
    reject_if_used(
        "selective_scan_fn",
        block_idx_first_scheduled_token=block_idx_first_scheduled_token,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
    )
    varlen = query_start_loc is not None
    if u.dim() != (2 if varlen else 3) or delta.shape != u.shape:
        form = "[dim, total_tokens] with query_start_loc" if varlen else "[batch, dim, length]"
        raise OpInputError(
            f"selective_scan_fn: u and delta must be {form} and alike, got u {describe(u)}, "
            f"delta {describe(delta)}"
        )
    dim, dstate = A.shape
    if u.size(-2) != dim or ssm_states.dim() != 3 or tuple(ssm_states.shape[1:]) != (dim, dstate):
        raise OpInputError(
            f"selective_scan_fn: A {describe(A)} needs u [.., {dim}, ..] and ssm_states "
            f"[lines, {dim}, {dstate}], got u {describe(u)}, ssm_states {describe(ssm_states)}"
        )
    Bg, Cg = _groups(B, "B", varlen), _groups(C, "C", varlen)
    groups = Bg.size(1)
    if dim % groups or Bg.size(2) != dstate or Cg.shape != Bg.shape:
        raise OpInputError(
            f"selective_scan_fn: B {describe(B)} and C {describe(C)} must hold {dstate} states "
            f"in a number of groups dividing dim {dim}"
        )
    if varlen:
        offsets = [int(s) for s in query_start_loc.tolist()]
        if offsets[0] != 0 or offsets[-1] != u.size(1):
            raise OpInputError(
                f"selective_scan_fn: query_start_loc must run from 0 to {u.size(1)}, got "
                f"{offsets[:9]}"
            )
        # token-major rows: [total, dim] and [total, groups, dstate]
        rows = {"u": u.t(), "dt": delta.t(), "B": Bg[0].permute(2, 0, 1)}
        rows["C"] = Cg[0].permute(2, 0, 1)
        z_rows = z.t() if z is not None else None
    else:
        batch, _, length = u.shape
        offsets = [b * length for b in range(batch + 1)]
        rows = {
            "u": u.transpose(1, 2).reshape(-1, dim),
            "dt": delta.transpose(1, 2).reshape(-1, dim),
            "B": Bg.permute(0, 3, 1, 2).reshape(-1, groups, dstate),
            "C": Cg.permute(0, 3, 1, 2).reshape(-1, groups, dstate),
        }
        z_rows = z.transpose(1, 2).reshape(-1, dim) if z is not None else None
    num_seqs = len(offsets) - 1
    lines = (
        cache_indices.to(torch.int64).view(-1)
        if cache_indices is not None
        else torch.arange(num_seqs, device=u.device)
    )
    live = lines != pad_slot_id
    index, valid = pad_index(offsets, u.device)  # [N, Tmax]
    x = rows["u"][index].float()  # [N, Tmax, dim]
    dt = rows["dt"][index].float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()
    if delta_softplus:
        dt = F.softplus(dt)
    # a padded step neither decays nor feeds the state: dt = 0 there
    dt = dt * valid.unsqueeze(-1)
    per = dim // groups
    Bt = rows["B"][index].float().repeat_interleave(per, dim=2)  # [N, Tmax, dim, dstate]
    Ct = rows["C"][index].float().repeat_interleave(per, dim=2)
    start = torch.zeros(num_seqs, dim, dstate, dtype=torch.float32, device=u.device)
    if has_initial_state is not None:
        keep = has_initial_state.to(u.device, torch.bool).view(-1) & live
        if bool(keep.any()):
            start[keep] = ssm_states[lines[keep]].float()
    state = start
    Af = A.float()
    ys = []
    for t in range(x.size(1)):
        decay = torch.exp(dt[:, t, :, None] * Af)
        state = decay * state + (dt[:, t] * x[:, t])[..., None] * Bt[:, t]
        ys.append((state * Ct[:, t]).sum(-1))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)  # [N, Tmax, dim]
    if D is not None:
        y = y + x * D.float()
    if z_rows is not None:
        y = y * F.silu(z_rows[index].float())
    if bool(live.any()):
        ssm_states[lines[live]] = state[live].to(ssm_states.dtype)
    out = z if z is not None else delta
    keep_rows = valid & live.view(-1, 1)
    flat_index = index[keep_rows]
    values = y[keep_rows].to(out.dtype)
    if varlen:
        out.t()[flat_index] = values
    else:
        out_rows = out.transpose(1, 2).reshape(-1, dim)
        out_rows[flat_index] = values
        out.copy_(out_rows.view(u.size(0), -1, dim).transpose(1, 2))
    return out


__all__ = ["PAD_SLOT_ID", "selective_scan_fn"]
