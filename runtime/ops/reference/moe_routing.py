"""MoE token routing: torch_npu.npu_moe_init_routing_v2, npu_moe_finalize_routing and
npu_moe_re_routing (torch_npu 2.13.0), dropless only.

Worked example, 3 rows, K = 2, experts 0..3, ``expert_idx = [[2, 0], [1, 2], [0, 3]]``:

    flat source index s = row * K + choice:   s  0  1  2  3  4  5
                                          expert  2  0  1  2  0  3
    stable sort by expert -> destination d:   d  0  1  2  3  4  5
                                          source  1  4  2  0  3  5
    expanded_x[d]         = x[source[d] // K]        rows 0, 2, 1, 0, 1, 2
    expanded_row_idx[s]   = d (row_idx_type 0)       [3, 0, 2, 4, 1, 5]
    tokens per expert     = [2, 1, 2, 1]             (expert_tokens_num_type 1)

finalize_routing reverses it: ``out[i] = sum_k scales[i, k] * expanded[idx(i, k)]`` where
drop_pad_mode 2 reads ``idx(i, k) = expanded_src_to_dst_row[i * K + k]`` (the layout above) and
mode 0 reads ``expanded_src_to_dst_row[k * rows + i]`` (choice-major, the older layout).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import (
    FLOAT_DTYPES,
    OpInputError,
    ReferenceUnsupportedError,
    describe,
    require_dtype,
    require_rank,
)
from .npu_limits import require_npu_dtype
from .refused import QUANTIZED, refuse

#: npu_moe_init_routing_v2 参数说明: expert_num "key_value模式时 (0, 5120]；其他模式 (0, 10240]"
MAX_EXPERTS = {1: 10240, 2: 5120}
#: npu_moe_re_routing 参数说明 (op-plugin page): "H：表示token长度，取值要求0<H<16384"
MAX_TOKEN_LENGTH = 16384


def npu_moe_init_routing_v2(
    x: Tensor,
    expert_idx: Tensor,
    *,
    scale: Tensor | None = None,
    offset: Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: list[int] = [],  # noqa: B006 - the schema's default, never mutated
    row_idx_type: int = 0,
    x_dtype: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Expand ``x`` [rows, H] by ``expert_idx`` [rows, K] and sort the copies by expert.

    Returns:
        ``(expanded_x [rows*K, H], expanded_row_idx [rows*K] int32, expert_tokens int64,
        expanded_scale [rows*K] float32)``. Rows past the number of selections inside
        ``active_expert_range`` are zero (the device leaves them undefined); so is
        ``expanded_scale`` without ``scale``.
    """
    op = "npu_moe_init_routing_v2"
    if quant_mode != -1 or x.dtype == torch.int8 or x_dtype is not None or offset is not None:
        refuse(op + " (quant_mode/int8 x/x_dtype/offset)", QUANTIZED)
    _check_init_args(op, x, expert_idx, drop_pad_mode, expert_tokens_num_type)
    if not expert_tokens_num_flag:
        raise OpInputError(f"{op}: expert_tokens_num_flag must be True (当前仅支持True)")
    if not 0 < expert_num <= MAX_EXPERTS[expert_tokens_num_type]:
        raise OpInputError(
            f"{op}: expert_num must be in (0, {MAX_EXPERTS[expert_tokens_num_type]}] for "
            f"expert_tokens_num_type {expert_tokens_num_type}, got {expert_num}"
        )
    start, end = _expert_range(op, active_expert_range, expert_num)
    num_rows, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    if bool(((flat < 0) | (flat >= expert_num)).any()):
        raise OpInputError(f"{op}: expert_idx must lie in [0, {expert_num})")
    active = (flat >= start) & (flat < end)
    num_active = int(active.sum())
    if 0 < active_num < num_active:
        raise ReferenceUnsupportedError(
            f"{op}: active_num={active_num} below the {num_active} selections truncates the "
            "output, which the reference does not model; pass -1 or rows*K"
        )
    # selections outside the range sort after every active one (key `end`), stably
    dst_to_src = torch.sort(torch.where(active, flat, end), stable=True).indices
    kept = dst_to_src[:num_active]
    expanded_x = x.new_zeros(num_rows * k, x.size(1))
    expanded_x[:num_active] = x[kept // k]
    expanded_row_idx = torch.full((num_rows * k,), -1, dtype=torch.int32, device=x.device)
    if row_idx_type == 0:  # gather: indexed by source, -1 where not routed
        expanded_row_idx[kept] = torch.arange(num_active, dtype=torch.int32, device=x.device)
    else:  # scatter: indexed by destination
        expanded_row_idx[:num_active] = kept.to(torch.int32)
    counts = torch.bincount(flat[active] - start, minlength=end - start)
    expanded_scale = torch.zeros(num_rows * k, dtype=torch.float32, device=x.device)
    if scale is not None:
        if scale.dim() != 1 or scale.numel() != num_rows:
            raise OpInputError(
                f"{op}: unquantized `scale` must be [{num_rows}], got {describe(scale)}"
            )
        expanded_scale[:num_active] = scale.float()[kept // k]
    return (
        expanded_x,
        expanded_row_idx,
        _token_counts(counts, start, expert_num, expert_tokens_num_type),
        expanded_scale,
    )


def _check_init_args(
    op: str, x: Tensor, expert_idx: Tensor, drop_pad_mode: int, num_type: int
) -> None:
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_rank(op, "x", x, 2, 2)
    require_rank(op, "expert_idx", expert_idx, 2, 2)
    require_dtype(op, "expert_idx", expert_idx, (torch.int32,))
    if expert_idx.size(0) != x.size(0):
        raise OpInputError(f"{op}: expert_idx rows {expert_idx.size(0)} != x rows {x.size(0)}")
    if drop_pad_mode != 0:
        raise OpInputError(f"{op}: drop_pad_mode must be 0 (当前仅支持0), got {drop_pad_mode}")
    if num_type not in (1, 2):
        raise OpInputError(
            f"{op}: expert_tokens_num_type must be 1 (count) or 2 (key_value) (当前仅支持1和2), "
            f"got {num_type}"
        )


def _expert_range(op: str, active_expert_range: list[int], expert_num: int) -> tuple[int, int]:
    if not active_expert_range:
        return 0, expert_num
    if len(active_expert_range) != 2:
        raise OpInputError(
            f"{op}: active_expert_range must be [start, end], got {active_expert_range}"
        )
    start, end = (int(v) for v in active_expert_range)
    if not 0 <= start < end <= expert_num:
        raise OpInputError(
            f"{op}: active_expert_range must satisfy 0 <= start < end <= expert_num={expert_num}, "
            f"got {active_expert_range}"
        )
    return start, end


def _token_counts(counts: Tensor, start: int, expert_num: int, num_type: int) -> Tensor:
    """Count mode: one count per expert of the range; key_value mode: (expert, count) pairs of
    the experts that got tokens, then a (0, 0) terminator, padded with zeros to expert_num rows."""
    counts = counts.to(torch.int64)
    if num_type == 1:
        return counts
    pairs = torch.zeros(expert_num, 2, dtype=torch.int64, device=counts.device)
    busy = torch.nonzero(counts).flatten()
    pairs[: busy.numel(), 0] = busy + start
    pairs[: busy.numel(), 1] = counts[busy]
    return pairs


def npu_moe_finalize_routing(
    expanded_permuted_rows: Tensor,
    skip1: Tensor | None,
    skip2: Tensor | None,
    bias: Tensor | None,
    scales: Tensor | None,
    expanded_src_to_dst_row: Tensor,
    export_for_source_row: Tensor | None,
    drop_pad_mode: int | None = 0,
    k: int | None = 1,
) -> Tensor:
    """Combine the experts' rows back into one row per token (formula in the module docstring).

    NOTE: the 2.13.0 wheel's docstring allows drop_pad_mode 0 only; the op-plugin page
    (docs/context/torch_npu-npu_moe_finalize_routing.md) defines 0-3, and the framework passes
    2 with init_routing_v2's source-major index. Modes 0 and 2 (dropless) are modelled; 1 and 3
    (drop/pad) are not.
    """
    op = "npu_moe_finalize_routing"
    mode = 0 if drop_pad_mode is None else drop_pad_mode
    if mode in (1, 3):
        raise ReferenceUnsupportedError(f"{op}: drop_pad_mode {mode} (drop/pad) is not modelled")
    if mode not in (0, 2):
        raise OpInputError(f"{op}: drop_pad_mode must be in [0, 3], got {mode}")
    rows = expanded_permuted_rows
    require_dtype(op, "expanded_permuted_rows", rows, FLOAT_DTYPES)
    require_rank(op, "expanded_permuted_rows", rows, 2, 2)
    top_k = scales.size(1) if scales is not None else (k or 1)
    total = expanded_src_to_dst_row.numel()
    if expanded_src_to_dst_row.dim() != 1 or total % top_k:
        raise OpInputError(
            f"{op}: expanded_src_to_dst_row must be 1-D [rows*K] with K={top_k}, got "
            f"{describe(expanded_src_to_dst_row)}"
        )
    num_rows = total // top_k
    if rows.size(0) != total:
        raise OpInputError(
            f"{op}: expanded_permuted_rows must have {total} rows, got {rows.size(0)}"
        )
    if skip2 is None and skip1 is not None:
        raise OpInputError(f"{op}: skip1 must be None when skip2 is None")
    index = expanded_src_to_dst_row.long()
    if bool(((index < 0) | (index >= total)).any()):
        raise OpInputError(f"{op}: expanded_src_to_dst_row must lie in [0, {total})")
    # index laid out [rows, K]: mode 2 is already row-major, mode 0 is choice-major
    index = index.view(num_rows, top_k) if mode == 2 else index.view(top_k, num_rows).t()
    picked = rows.float()[index]  # [rows, K, H]
    if bias is not None:
        if export_for_source_row is None:
            raise OpInputError(
                f"{op}: `bias` needs export_for_source_row (the expert of each pick)"
            )
        picked = picked + bias.float()[export_for_source_row.long()]
    weights = scales.float().unsqueeze(-1) if scales is not None else 1.0
    out = (picked * weights).sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows.dtype)


def npu_moe_re_routing(
    tokens: Tensor,
    expert_token_num_per_rank: Tensor,
    *,
    per_token_scales: Tensor | None = None,
    expert_token_num_type: int = 1,
    idx_type: int = 0,
    tokens_dtype: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reorder tokens received rank-major ([rank][expert] blocks) into expert-major order.

    ``expert_token_num_per_rank`` [N ranks, E experts] counts the tokens of each block.

    Returns:
        ``(permute_tokens [A, H], permute_per_token_scales [A] float32 (zeros without scales),
        permute_token_idx [A] int32 (gather index: output j is tokens[idx[j]]),
        expert_token_num [E] (counts, the counts' dtype))``.
    """
    op = "npu_moe_re_routing"
    if tokens.dtype == torch.int8 or tokens_dtype is not None:
        refuse(op + " (int8 tokens)", QUANTIZED)
    # 参数说明 lists float16/bfloat16/int8; float32 runs on the CPU for fp32 verification
    require_dtype(op, "tokens", tokens, FLOAT_DTYPES)
    require_npu_dtype(op, "tokens", tokens, (torch.float16, torch.bfloat16))
    require_rank(op, "tokens", tokens, 2, 2)
    if not 0 < tokens.size(1) < MAX_TOKEN_LENGTH:
        raise OpInputError(
            f"{op}: token length H must be in (0, {MAX_TOKEN_LENGTH}), got {tokens.size(1)}"
        )
    counts = expert_token_num_per_rank
    require_rank(op, "expert_token_num_per_rank", counts, 2, 2)
    require_dtype(op, "expert_token_num_per_rank", counts, (torch.int32, torch.int64))
    if expert_token_num_type != 1 or idx_type != 0:
        raise OpInputError(
            f"{op}: only expert_token_num_type=1 and idx_type=0 are supported (当前只支持), got "
            f"{expert_token_num_type} and {idx_type}"
        )
    # NOTE: 参数说明 says the counts must be > 0, yet experts that receive no token give 0;
    # unconfirmed whether the device rejects zeros, so only negatives are refused here.
    if bool((counts < 0).any()) or int(counts.sum()) != tokens.size(0):
        raise OpInputError(
            f"{op}: expert_token_num_per_rank must be >= 0 and sum to the {tokens.size(0)} tokens"
        )
    num_ranks, num_experts = counts.shape
    block = torch.arange(num_ranks * num_experts, device=tokens.device)
    block_of_token = block.repeat_interleave(counts.reshape(-1).long())
    rank, expert = block_of_token // num_experts, block_of_token % num_experts
    gather = torch.sort(expert * num_ranks + rank, stable=True).indices
    scales = torch.zeros(tokens.size(0), dtype=torch.float32, device=tokens.device)
    if per_token_scales is not None:
        scales = per_token_scales.float()[gather]
    return tokens[gather], scales, gather.to(torch.int32), counts.sum(dim=0)
