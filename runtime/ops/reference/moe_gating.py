"""MoE router: torch_npu.npu_moe_gating_top_k_softmax (torch_npu 2.13.0).

    y, expert_idx = topk(softmax(x, -1), k)        # y in x's dtype, expert_idx int32
    row_idx[i, j] = j * num_rows + i               # num_rows = x.numel() // num_experts

``row_idx`` numbers the (row, choice) pairs choice-major. NOTE: the docs only say it "indicates
the original row of each position"; the choice-major numbering is derived from the callers that
build it by hand (``arange(num_rows * k).view(k, -1).t()``) and is unconfirmed on hardware.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import (
    FLOAT_DTYPES,
    OpInputError,
    ReferenceUnsupportedError,
    require_dtype,
    require_rank,
)

#: 参数说明: "0<k<=x的-1轴大小, k<=1024"
MAX_TOP_K = 1024


def npu_moe_gating_top_k_softmax(
    x: Tensor, finished: Tensor | None = None, k: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax over the experts of each row of ``x`` [rows, E] or [B, S, E], then top ``k``.

    Returns:
        ``(y, expert_idx, row_idx)``, each of x's shape with the last dim ``k``; ties pick the
        lower expert id (unconfirmed on hardware).
    """
    op = "npu_moe_gating_top_k_softmax"
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_rank(op, "x", x, 2, 3)
    num_experts = x.size(-1)
    if not 0 < k <= min(num_experts, MAX_TOP_K):
        raise OpInputError(f"{op}: k must be in [1, min(E={num_experts}, {MAX_TOP_K})], got {k}")
    if finished is not None:
        # NOTE: the docs name the rows finished marks but not what the outputs hold for them.
        raise ReferenceUnsupportedError(
            f"{op}: `finished` is not modelled (its outputs are undocumented); pass None"
        )
    probs = torch.softmax(x.float(), dim=-1)
    # stable descending sort: equal probabilities keep the lower expert id first
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :k]
    y = probs.gather(-1, order).to(x.dtype)
    num_rows = x.numel() // num_experts
    choice_major = torch.arange(num_rows * k, dtype=torch.int32, device=x.device)
    row_idx = choice_major.view(k, num_rows).t().reshape(y.shape)
    return y, order.to(torch.int32), row_idx
