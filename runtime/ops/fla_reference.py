"""The FLA entry points' reference implementations, in plain PyTorch.

``kvskill.runtime.ops.fla`` is what converted code calls: on an NPU it hands each call that
fits a torch_npu operator to that operator (``fla_npu.py``) and every other call to these.

Signatures follow vLLM's FLA / causal-conv1d operators (npu_ops.md §5), which the AscendC
``fla_npu.ops.ascendc`` interface mirrors (unconfirmed: keyword-for-keyword identity with that
interface; these follow vLLM's names). Sequences are packed with cumulative offsets that start
at 0 (``query_start_loc`` / ``cu_seqlens``, length B + 1). State rows are addressed by index
tensors; ``pad_slot_id`` rows are skipped.

Work is vectorised over channels and heads; the convolution loops over sequences (O(B) small
ops) and the gated delta recurrence over time steps of all sequences at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference._checks import OpInputError, describe, reject_if_used
from .reference.gated_delta import gated_delta_scan, l2norm, pad_index
from .selective_scan import selective_scan_fn

PAD_SLOT_ID = -1


#: the activation values the causal conv takes (None/False: none)
ACTIVATIONS = (None, False, True, "silu", "swish")


def activate(y: Tensor, activation: str | bool | None) -> Tensor:
    """The causal conv's activation: none, or SiLU ("silu", "swish", True)."""
    if activation in (None, False):
        return y
    if activation in ("silu", "swish", True):
        return F.silu(y)
    raise OpInputError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def _conv(xp: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Depthwise valid convolution: xp [dim, W-1+L] -> [dim, L] (fp32)."""
    w = weight.float().unsqueeze(1)  # [dim, 1, W]
    b = bias.float() if bias is not None else None
    return F.conv1d(xp.unsqueeze(0), w, b, groups=weight.size(0)).squeeze(0)


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    query_start_loc: Tensor,
    cache_indices: Tensor | None = None,
    has_initial_state: Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    block_idx_first_scheduled_token: Tensor | None = None,
    block_idx_last_scheduled_token: Tensor | None = None,
    initial_state_idx: Tensor | None = None,
    num_computed_tokens: Tensor | None = None,
    block_size_to_align: int = 0,
    metadata: object = None,
    validate_data: bool = False,
) -> Tensor:
    """Causal depthwise conv1d over packed sequences (prefill), updating ``conv_states``.

    Args:
        x: [dim, total_tokens].
        weight: [dim, W]; bias: [dim] or None.
        conv_states: [num_lines, dim, state_len >= W - 1], updated in place.
        query_start_loc: [B + 1] cumulative token offsets starting at 0.
        cache_indices: [B] state line per sequence (default: line b); ``pad_slot_id`` = skip.
        has_initial_state: [B] bool; False means the sequence starts from zeros.

    For sequence i with tokens x_i [dim, L]: ``init`` = last W-1 columns of its state line (or
    zeros), ``y[:, t] = bias + sum_k weight[:, k] * cat(init, x_i)[:, t + k]``, then activation.
    The state line becomes the last ``state_len`` columns of ``cat(old line or zeros, x_i)``.
    Returns y [dim, total_tokens] in x's dtype; skipped sequences' columns are left zero
    (unspecified on device).
    """
    reject_if_used(
        "causal_conv1d_fn",
        block_idx_first_scheduled_token=block_idx_first_scheduled_token,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
        num_computed_tokens=num_computed_tokens,
    )
    dim, width = weight.shape
    if x.dim() != 2 or x.size(0) != dim:
        raise OpInputError(
            f"causal_conv1d_fn: x must be [dim={dim}, total_tokens], got {describe(x)}"
        )
    state_len = conv_states.size(-1)
    if conv_states.dim() != 3 or conv_states.size(1) != dim or state_len < width - 1:
        raise OpInputError(
            f"causal_conv1d_fn: conv_states must be [lines, {dim}, >= {width - 1}], got "
            f"{describe(conv_states)}"
        )
    starts = [int(s) for s in query_start_loc.tolist()]
    if (
        starts[0] != 0
        or starts[-1] != x.size(1)
        or any(b < a for a, b in zip(starts, starts[1:], strict=False))
    ):
        raise OpInputError(
            f"causal_conv1d_fn: query_start_loc must be cumulative from 0 to {x.size(1)}, got "
            f"{starts[:9]}"
        )
    num_seqs = len(starts) - 1
    lines = cache_indices.tolist() if cache_indices is not None else list(range(num_seqs))
    has_init = has_initial_state.tolist() if has_initial_state is not None else [False] * num_seqs
    out = torch.zeros_like(x)
    for i in range(num_seqs):
        line = int(lines[i])
        if line == pad_slot_id:
            continue
        xi = x[:, starts[i] : starts[i + 1]].float()
        old = conv_states[line].float() if has_init[i] else xi.new_zeros(dim, state_len)
        xp = torch.cat((old[:, state_len - (width - 1) :], xi), dim=1)
        out[:, starts[i] : starts[i + 1]] = activate(_conv(xp, weight, bias), activation).to(
            x.dtype
        )
        conv_states[line] = torch.cat((old, xi), dim=1)[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    query_start_loc: Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = PAD_SLOT_ID,
    block_idx_last_scheduled_token: Tensor | None = None,
    initial_state_idx: Tensor | None = None,
    retrieve_parent_token: Tensor | None = None,
    validate_data: bool = False,
) -> Tensor:
    """Decode-time causal conv1d using the stored state as left context (state updated in place).

    Args:
        x: [B, dim] (one token), [B, dim, L], or packed [num_tokens, dim] with
            ``query_start_loc`` [B + 1].
        conv_state: [num_lines, dim, state_len >= W - 1].
        conv_state_indices: [B] state line per sequence (default: line b); pad id = skip.
            Or [B, max_L] (a speculative verify step): sequence b starts from line
            ``idx[b, 0]`` and line ``idx[b, t]`` receives the state after its token t, so
            the caller keeps the state of whichever token was accepted last (the
            framework's 1 + next_n state blocks); pad ids are skipped.

    Context = the first W-1 columns of the line (the whole line when state_len = W-1); the line
    then shifts left by L and the new tokens are appended. Note the activation default is None
    here (``causal_conv1d_fn`` defaults to "silu"). Returns y shaped like x.
    """
    reject_if_used(
        "causal_conv1d_update",
        num_accepted_tokens=num_accepted_tokens,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
        retrieve_parent_token=retrieve_parent_token,
    )
    dim, width = weight.shape
    state_len = conv_state.size(-1)
    if conv_state.dim() != 3 or conv_state.size(1) != dim or state_len < width - 1:
        raise OpInputError(
            f"causal_conv1d_update: conv_state must be [lines, {dim}, >= {width - 1}], got "
            f"{describe(conv_state)}"
        )
    seqs = _update_sequences(x, dim, query_start_loc)
    if conv_state_indices is None:
        lines = [[b] for b in range(len(seqs))]
    else:
        lines = conv_state_indices.view(conv_state_indices.size(0), -1).tolist()
    per_token = conv_state_indices is not None and conv_state_indices.dim() == 2
    out = torch.zeros_like(x)
    for b, (read, write) in enumerate(seqs):
        line = int(lines[b][0])
        if line == pad_slot_id or (per_token and line < 0):
            continue
        xb = read(x).float()  # [dim, L]
        old = conv_state[line].float()
        xp = torch.cat((old[:, : width - 1], xb), dim=1)
        write(out, activate(_conv(xp, weight, bias), activation).to(x.dtype))
        history = torch.cat((old, xb), dim=1)
        if not per_token or len(lines[b]) == 1:
            conv_state[line] = history[:, -state_len:].to(conv_state.dtype)
            continue
        if len(lines[b]) < xb.size(1):
            raise OpInputError(
                f"causal_conv1d_update: 2-D conv_state_indices need a line per token "
                f"(width >= {xb.size(1)}), got {describe(conv_state_indices)}"
            )
        for t in range(xb.size(1)):
            target = int(lines[b][t])
            if target >= 0 and target != pad_slot_id:
                # the line after token t: the state_len inputs ending at it
                end = old.size(1) + t + 1
                conv_state[target] = history[:, end - state_len : end].to(conv_state.dtype)
    return out


def _update_sequences(x: Tensor, dim: int, query_start_loc: Tensor | None) -> list:
    """(read, write) accessors per sequence over x's layout, each giving/taking [dim, L]."""
    if query_start_loc is not None:
        if x.dim() != 2 or x.size(1) != dim:
            raise OpInputError(
                f"causal_conv1d_update: packed x must be [num_tokens, {dim}], got {describe(x)}"
            )
        starts = [int(s) for s in query_start_loc.tolist()]
        return [_packed_access(a, b) for a, b in zip(starts, starts[1:], strict=False)]
    if x.dim() == 2 and x.size(1) == dim:
        return [_token_access(b) for b in range(x.size(0))]
    if x.dim() == 3 and x.size(1) == dim:
        return [_batch_access(b) for b in range(x.size(0))]
    raise OpInputError(
        f"causal_conv1d_update: x must be [B, {dim}], [B, {dim}, L] or packed [T, {dim}] with "
        f"query_start_loc; got {describe(x)}"
    )


def _packed_access(a: int, b: int):
    def read(x: Tensor) -> Tensor:
        return x[a:b].t()

    def write(out: Tensor, y: Tensor) -> None:
        out[a:b] = y.t()

    return read, write


def _token_access(b: int):
    def read(x: Tensor) -> Tensor:
        return x[b].unsqueeze(1)

    def write(out: Tensor, y: Tensor) -> None:
        out[b] = y[:, 0]

    return read, write


def _batch_access(b: int):
    def read(x: Tensor) -> Tensor:
        return x[b]

    def write(out: Tensor, y: Tensor) -> None:
        out[b] = y

    return read, write


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    inplace_final_state: bool = True,
    cu_seqlens: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    retrieve_parent_token: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, token by token (decode / short prefill), FLA layouts.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0; value head h reads q/k head
            h // (HV // H)); g: [B, T, HV] log decay; beta: [B, T, HV] (default 1).
        scale: default K ** -0.5.
        initial_state: [num_states, HV, K, V] (key-major, FLA orientation). Without
            ``ssm_state_indices`` sequence n starts from row n.
        cu_seqlens: [N + 1] cumulative offsets from 0; requires B == 1 (packed).
        ssm_state_indices: [N] (start from and write the final state to row idx[n]) or
            [N, max_T] (start from idx[n, 0]; the state after token t goes to idx[n, t]).
            Pad ids (< 0) are skipped.
        inplace_final_state: write states into ``initial_state``; otherwise a new
            [total_tokens, HV, K, V] tensor receives the state after every token.

    Returns:
        (o [B, T, HV, V] in q's dtype, final_state).
    """
    reject_if_used(
        "fused_recurrent_gated_delta_rule",
        num_accepted_tokens=num_accepted_tokens,
        retrieve_parent_token=retrieve_parent_token,
    )
    if cu_seqlens is not None and q.size(0) != 1:
        raise OpInputError(
            f"fused_recurrent_gated_delta_rule: with cu_seqlens the batch must be 1 (packed), "
            f"got q {describe(q)}"
        )
    bsz, t_total, h, kdim = q.shape
    hv = v.size(2)
    if hv % h:
        raise OpInputError(
            f"fused_recurrent_gated_delta_rule: value heads {hv} not a multiple of {h}"
        )
    scale = kdim**-0.5 if scale is None else scale
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=torch.float32, device=v.device)
    if cu_seqlens is not None:
        offsets = [int(c) for c in cu_seqlens.tolist()]
    else:
        offsets = [i * t_total for i in range(bsz + 1)]
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v, g, beta)]
    lens = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    idx, valid = pad_index(offsets, q.device)
    qp, kp, vp, gp, bp = (x[idx] for x in flat)  # [N, Tmax, ...]
    if use_qk_l2norm_in_kernel:
        qp, kp = l2norm(qp), l2norm(kp)
    group = hv // h
    qp = qp.float().repeat_interleave(group, dim=2) * scale
    kp = kp.float().repeat_interleave(group, dim=2)
    n = len(lens)
    rows = ssm_state_indices.long().view(n, -1) if ssm_state_indices is not None else None
    if rows is not None and rows.size(1) > 1 and rows.size(1) < max(lens, default=0):
        raise OpInputError(
            f"fused_recurrent_gated_delta_rule: 2-D ssm_state_indices need one slot per token "
            f"(width >= {max(lens)}), got {describe(ssm_state_indices)}"
        )
    if initial_state is None:
        h0 = torch.zeros(n, hv, kdim, v.size(-1), dtype=torch.float32, device=q.device)
    elif rows is not None:
        # Pad ids start from zeros; their results are never stored.
        h0 = initial_state[rows[:, 0].clamp(min=0)].float()
    else:
        h0 = initial_state[:n].float()
    per_token: list[Tensor] = []
    every_token = initial_state is not None and not inplace_final_state
    step_rows = rows is not None and rows.size(1) > 1 and inplace_final_state

    def keep(t: int, state: Tensor, live: Tensor) -> None:
        if every_token:
            per_token.append(state.clone())
        elif step_rows and initial_state is not None:
            _store(initial_state, rows[:, t], state, live.view(-1))

    out, h_final = gated_delta_scan(
        qp, kp, vp, gp, bp, h0, torch.tensor(lens, device=q.device), on_step=keep
    )
    o = out[valid].view(bsz, t_total, hv, -1).to(q.dtype)
    if initial_state is None:
        return o, h_final.to(q.dtype)
    if every_token:
        # A new [total_tokens, HV, K, V] tensor: the state after each token.
        return o, torch.stack(per_token, dim=1)[valid].to(initial_state.dtype)
    if rows is None:
        initial_state[:n] = h_final.to(initial_state.dtype)
    elif not step_rows:
        _store(
            initial_state, rows[:, 0], h_final, torch.ones(n, dtype=torch.bool, device=rows.device)
        )
    return o, initial_state


def _store(states: Tensor, rows: Tensor, value: Tensor, live: Tensor) -> None:
    ok = live & (rows >= 0)
    states[rows[ok]] = value[ok].to(states.dtype)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule for prefill, FLA layouts; states are inputs/outputs, not written in place.

    Shapes as ``fused_recurrent_gated_delta_rule``: q, k [B, T, H, K], v [B, T, HV, V]
    (``head_first`` is not supported), ``cu_seqlens`` [N + 1] with B == 1, initial_state
    [N, HV, K, V]. unconfirmed: the state orientation of the Ascend Triton port (its docstring
    says [N, H, K, V] like FLA, its callers use [N, HV, V, K]); the reference follows FLA.

    Returns:
        (o [B, T, HV, V], final_state [N, HV, K, V] or None unless ``output_final_state``).
    """
    if head_first:
        raise OpInputError("chunk_gated_delta_rule: head_first=True is not supported")
    n = (cu_seqlens.numel() - 1) if cu_seqlens is not None else q.size(0)
    start = (
        initial_state.clone()
        if initial_state is not None
        else torch.zeros(n, v.size(2), k.size(-1), v.size(-1), dtype=torch.float32, device=q.device)
    )
    o, final = fused_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=start,
        inplace_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o, (final if output_final_state else None)


#: the name the AscendC FLA interface uses for the token-by-token gated delta rule
recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule


def check_channel_gate(op: str, k: Tensor, v: Tensor, g: Tensor) -> None:
    expected = (*v.shape[:3], k.size(-1))
    if tuple(g.shape) != expected:
        raise OpInputError(
            f"{op}: g must hold one log decay per key channel, [B, T, HV, K] = "
            f"{list(expected)}, got {describe(g)} (a decay per head is the gated delta rule)"
        )


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Kimi delta attention (KDA), prefill form: the gated delta rule with its decay per key
    channel, ``h <- diag(exp(g_t)) h`` instead of ``exp(g_t) h``.

    Shapes and states as ``chunk_gated_delta_rule`` except g [B, T, HV, K]. unconfirmed:
    keyword-for-keyword identity with vLLM's / FLA's ``chunk_kda``; these follow the gated
    delta operators' names.
    """
    check_channel_gate("chunk_kda", k, v, g)
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    inplace_final_state: bool = True,
    cu_seqlens: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor]:
    """Kimi delta attention, token by token (decode): ``fused_recurrent_gated_delta_rule``
    with g [B, T, HV, K], one log decay per key channel. Same unconfirmed naming as
    ``chunk_kda``."""
    check_channel_gate("fused_recurrent_kda", k, v, g)
    return fused_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        inplace_final_state=inplace_final_state,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=ssm_state_indices,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


__all__ = [
    "PAD_SLOT_ID",
    "causal_conv1d_fn",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "causal_conv1d_update",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "gated_delta_scan",
    "l2norm",
    "recurrent_gated_delta_rule",
    "selective_scan_fn",
]
