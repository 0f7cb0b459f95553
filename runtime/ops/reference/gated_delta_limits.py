"""Documented limits of torch_npu's gated delta rule operators (torch_npu 2.13.0 docs).

Head counts and dims the docs bound are always checked where CPU tests stay inside them;
dtypes (profile ``dtypes``) and the chunk kernel's fixed head dim of 128 (profile ``dims``) are
hardware-only, because verify shrinks heads and runs fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import OpInputError
from .npu_limits import NPU_ONLY, require_npu_dtype
from .npu_profile import current_profile

RECURRENT_MAX_HEADS = 256
RECURRENT_MAX_DIM = 256
CHUNK_MAX_HEADS = 64
CHUNK_HEAD_DIM = 128
_BF16 = (torch.bfloat16,)
_FP32 = (torch.float32,)
_INT32 = (torch.int32,)


def check_recurrent(op: str, query: Tensor, value: Tensor, **tensors: Tensor | None) -> None:
    """npu_recurrent_gated_delta_rule(_functional): 约束说明 "N_k <= 256, N_v <= 256, D_k <= 256,
    D_v <= 256" (L_i <= 8 is checked with the lengths); 参数说明 gives the dtypes."""
    nk, dk = query.size(1), query.size(2)
    nv, dv = value.size(1), value.size(2)
    if max(nk, nv) > RECURRENT_MAX_HEADS or max(dk, dv) > RECURRENT_MAX_DIM:
        raise OpInputError(
            f"{op}: heads (Nk={nk}, Nv={nv}) must be <= {RECURRENT_MAX_HEADS} and dims "
            f"(Dk={dk}, Dv={dv}) <= {RECURRENT_MAX_DIM}"
        )
    _dtypes(op, query=query, value=value, **tensors)


def check_chunk(op: str, query: Tensor, value: Tensor, **tensors: Tensor | None) -> None:
    """npu_chunk_gated_delta_rule: 约束说明 "N_k <= 64, N_v <= 64, D_k = 128, D_v = 128".

    NOTE: the same list also says L_i <= 8, which the doc's own example (seqlen 100) and the
    operator's purpose (prefill) contradict; it is not enforced (npu_ops.md §9).
    """
    nk, dk = query.size(1), query.size(2)
    nv, dv = value.size(1), value.size(2)
    if max(nk, nv) > CHUNK_MAX_HEADS:
        raise OpInputError(f"{op}: heads (Nk={nk}, Nv={nv}) must be <= {CHUNK_MAX_HEADS}")
    if current_profile().dims and (dk, dv) != (CHUNK_HEAD_DIM, CHUNK_HEAD_DIM):
        raise OpInputError(
            f"{op}: head dims must be Dk = Dv = {CHUNK_HEAD_DIM} on the NPU, got Dk={dk}, "
            f"Dv={dv} ({NPU_ONLY})"
        )
    _dtypes(op, query=query, value=value, **tensors)


def _dtypes(op: str, **tensors: Tensor | None) -> None:
    # 参数说明: q/k/v/beta/state bfloat16, g float32, lengths and indices int32
    for name, t in tensors.items():
        if name == "g":
            allowed = _FP32
        elif name in ("actual_seq_lengths", "ssm_state_indices", "num_accepted_tokens"):
            allowed = _INT32
        else:
            allowed = _BF16
        require_npu_dtype(op, name, t, allowed)
