"""The decode-step state operators as registered custom operators, for captured steps.

A converted gated-delta-net layer decodes with ``causal_conv1d_update`` (the conv state
rolled in place) and ``fused_recurrent_gated_delta_rule`` with ``inplace_final_state`` (the
recurrent state written in place). Their references read state indices and offsets on the
host, so under torch.compile each runs as one ``torch.ops.kvskill.*`` node that declares the
state it writes; its fake gives the output's shape (the fast-path signatures of
``fla_reference``). Other calls, and every eager call, take the normal entry point.
"""

from __future__ import annotations

from typing import Any

import kvskill.runtime.ops.fla_reference as fla_reference
import torch
from torch import Tensor

from .reference.graph_ops import compiling, register


def _conv_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
    conv_state_indices: Tensor | None,
    query_start_loc: Tensor | None,
    pad_slot_id: int,
) -> Tensor:
    return fla_reference.causal_conv1d_update(
        x,
        conv_state,
        weight,
        bias,
        activation,
        conv_state_indices=conv_state_indices,
        query_start_loc=query_start_loc,
        pad_slot_id=pad_slot_id,
    )


def _conv_update_fake(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
    conv_state_indices: Tensor | None,
    query_start_loc: Tensor | None,
    pad_slot_id: int,
) -> Tensor:
    return torch.empty_like(x)


CONV_UPDATE_OP = register(
    "causal_conv1d_update", _conv_update, _conv_update_fake, mutates_args=("conv_state",)
)


def _recurrent_in_place(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor | None,
    scale: float | None,
    initial_state: Tensor,
    cu_seqlens: Tensor | None,
    ssm_state_indices: Tensor | None,
    use_qk_l2norm_in_kernel: bool,
) -> Tensor:
    out, _ = fla_reference.fused_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        inplace_final_state=True,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=ssm_state_indices,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return out


def _recurrent_in_place_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor | None,
    scale: float | None,
    initial_state: Tensor,
    cu_seqlens: Tensor | None,
    ssm_state_indices: Tensor | None,
    use_qk_l2norm_in_kernel: bool,
) -> Tensor:
    # o [B, T, HV, V] in q's dtype
    return q.new_empty(*q.shape[:2], v.size(2), v.size(3))


RECURRENT_OP = register(
    "fused_recurrent_gated_delta_rule_",
    _recurrent_in_place,
    _recurrent_in_place_fake,
    mutates_args=("initial_state",),
)


def conv_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    query_start_loc: Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = fla_reference.PAD_SLOT_ID,
    block_idx_last_scheduled_token: Tensor | None = None,
    initial_state_idx: Tensor | None = None,
    retrieve_parent_token: Tensor | None = None,
    validate_data: bool = False,
) -> Tensor | None:
    """``causal_conv1d_update`` as the registered operator, or None outside its scope (one
    token or block per sequence, or packed tokens with ``query_start_loc`` as the converted
    layers pass them; no speculative-decoding or prefix-block arguments)."""
    extras = (
        num_accepted_tokens,
        block_idx_last_scheduled_token,
        initial_state_idx,
        retrieve_parent_token,
    )
    if any(e is not None for e in extras):
        return None
    if activation is True:
        activation = "silu"
    elif activation is False:
        activation = None
    return CONV_UPDATE_OP(
        x, conv_state, weight, bias, activation, conv_state_indices, query_start_loc, pad_slot_id
    )


def recurrent_in_place(
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
) -> tuple[Tensor, Tensor] | None:
    """``fused_recurrent_gated_delta_rule`` writing its final states in place as the
    registered operator, or None outside that scope."""
    if not inplace_final_state or initial_state is None:
        return None
    if num_accepted_tokens is not None or retrieve_parent_token is not None:
        return None
    out = RECURRENT_OP(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, ssm_state_indices,
        use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return out, initial_state


def recurrent_kda_in_place(
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
) -> tuple[Tensor, Tensor] | None:
    """``fused_recurrent_kda`` (one log decay per key channel) as the same registered
    operator: its reference is the gated delta rule after a check of the gate's shape."""
    fla_reference.check_channel_gate("fused_recurrent_kda", k, v, g)
    return recurrent_in_place(
        q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,
        ssm_state_indices, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )  # fmt: skip


#: entry point -> its registered form (same signature; None = run the entry point as usual)
CAPTURED: dict[str, Any] = {
    "causal_conv1d_update": conv_update,
    "fused_recurrent_gated_delta_rule": recurrent_in_place,
    "fused_recurrent_kda": recurrent_kda_in_place,
}


def captured_call(name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The registered operator's result for entry point NAME while a step is being compiled,
    else None (the entry point runs as usual)."""
    form = CAPTURED.get(name)
    if form is None or not compiling():
        return None
    return form(*args, **kwargs)
