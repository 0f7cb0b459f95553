"""Grouped matmul: torch_npu.npu_grouped_matmul (torch_npu 2.13.0), unquantized paths.

Two forms (公式1, ``y_i = x_i @ weight_i + bias_i``):

- lists, no ``group_list``: one matmul per (x_i, weight_i) pair;
- grouped along M (``group_type=0``): one x [M, K] whose rows are split into E consecutive
  groups by ``group_list``, weight [E, K, N]; the expert MoE layers use this after routing.

      group_list_type 0 (cumsum): [2, 3, 5]  -> rows 0-1 expert 0, row 2 expert 1, rows 3-4 expert 2
      group_list_type 1 (count):  [2, 1, 2]  -> the same split

Rows past the last group are zero (the device leaves them undefined). Products accumulate in
fp32 and are cast to x's dtype. The Python loop runs over groups (experts), never over tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, OpInputError, ReferenceUnsupportedError, describe, require_dtype
from .refused import QUANTIZED, refuse

#: 约束说明: "内轴限制InnerLimit为65536"; 参数说明: "列表最大长度为128"
INNER_LIMIT = 65536
MAX_LIST = 128
#: 非量化 bias dtype by x dtype (数据类型约束场景 table)
_BIAS_DTYPE = {
    torch.float16: torch.float16,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
}
OP = "npu_grouped_matmul"


def npu_grouped_matmul(
    x: list[Tensor],
    weight: list[Tensor],
    *,
    bias: list[Tensor] | None = None,
    scale: list[Tensor] | None = None,
    offset: list[Tensor] | None = None,
    antiquant_scale: list[Tensor] | None = None,
    antiquant_offset: list[Tensor] | None = None,
    per_token_scale: list[Tensor] | None = None,
    group_list: Tensor | None = None,
    activation_input: list[Tensor] | None = None,
    activation_quant_scale: list[Tensor] | None = None,
    activation_quant_offset: list[Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: list[int] | None = None,
    output_dtype: int | None = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[Tensor]:
    """Unquantized grouped matmul; returns one tensor per weight (split_item 0/1) or one
    tensor (split_item 2/3, the outputs concatenated along M)."""
    quant = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
             activation_quant_scale, activation_quant_offset, x_dtype, weight_dtype, scale_dtype,
             per_token_scale_dtype)  # fmt: skip
    if any(v is not None for v in quant) or any(t.dtype == torch.int8 for t in (*x, *weight)):
        refuse(OP + " (scale/antiquant/per-token/int8 arguments)", QUANTIZED)
    if activation_input is not None:
        raise OpInputError(f"{OP}: activation_input must be None (当前仅支持传入None)")
    if act_type:
        raise ReferenceUnsupportedError(
            f"{OP}: act_type {act_type} (fused activation) is not modelled"
        )
    _check_lists(x, weight, bias, output_dtype)
    split = 0 if split_item is None else split_item
    if split not in (0, 1, 2, 3):
        raise OpInputError(f"{OP}: split_item must be 0-3, got {split_item}")
    if group_list is None:
        if group_type not in (None, -1):
            raise OpInputError(f"{OP}: group_type {group_type} needs a group_list")
        if len(x) != len(weight) or (bias and len(bias) != len(weight)):
            raise OpInputError(f"{OP}: x, weight (and bias) lists must have one length")
        biases = bias or [None] * len(weight)
        outs = [_matmul(*args) for args in zip(x, weight, biases, strict=True)]
    else:
        outs = [_grouped_m(x, weight, bias, group_list, group_type, group_list_type)]
    return [torch.cat(outs, dim=0)] if split in (2, 3) and len(outs) > 1 else outs


def _check_lists(
    x: list[Tensor], weight: list[Tensor], bias: list[Tensor] | None, output_dtype: int | None
) -> None:
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        raise TypeError(f"{OP}: x and weight must be lists of tensors (Tensor[])")
    if not 0 < len(x) <= MAX_LIST or not 0 < len(weight) <= MAX_LIST:
        raise OpInputError(f"{OP}: x and weight lists must hold 1-{MAX_LIST} tensors")
    dtype = x[0].dtype
    for name, t in [*(("x", t) for t in x), *(("weight", t) for t in weight)]:
        require_dtype(OP, name, t, FLOAT_DTYPES)
        if t.dtype != dtype:
            raise OpInputError(
                f"{OP}: x and weight must share one dtype, got {dtype} and {t.dtype}"
            )
        if t.size(-1) >= INNER_LIMIT:
            raise OpInputError(
                f"{OP}: `{name}` last dim must be < {INNER_LIMIT}, got {describe(t)}"
            )
    for b in bias or ():
        if b.dim() != 1 or b.dtype != _BIAS_DTYPE[dtype]:
            raise OpInputError(
                f"{OP}: bias for {dtype} x must be 1-D {_BIAS_DTYPE[dtype]}, got {describe(b)}"
            )
    # NOTE: the binding takes a dtype code here; None (x's dtype) is the only unquantized choice
    # the reference accepts, besides x's own torch dtype.
    if output_dtype is not None and output_dtype != dtype:
        raise ReferenceUnsupportedError(
            f"{OP}: output_dtype {output_dtype!r} other than x's is not modelled"
        )


def _matmul(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    if w.dim() != 2 or x.size(-1) != w.size(0):
        raise OpInputError(f"{OP}: weight must be [K={x.size(-1)}, N], got {describe(w)}")
    y = x.float() @ w.float()
    return (y if b is None else y + b.float()).to(x.dtype)


def _grouped_m(
    x: list[Tensor], weight: list[Tensor], bias: list[Tensor] | None, group_list: Tensor,
    group_type: int | None, group_list_type: int | None,
) -> Tensor:  # fmt: skip
    if not isinstance(group_list, Tensor):
        raise ReferenceUnsupportedError(
            f"{OP}: group_list as a list of ints is not modelled; pass an int64 tensor"
        )
    if group_type != 0:
        raise OpInputError(
            f"{OP}: with a group_list tensor group_type must be 0 (M axis), got {group_type}"
        )
    if len(x) != 1 or x[0].dim() != 2:
        raise OpInputError(f"{OP}: grouping along M takes one 2-D x, got {len(x)} tensors")
    if bias:
        raise ReferenceUnsupportedError(f"{OP}: bias with a group_list is not modelled")
    w = weight[0] if len(weight) == 1 and weight[0].dim() == 3 else torch.stack(list(weight))
    num_groups = w.size(0)
    sizes = _group_sizes(group_list, group_list_type, num_groups)
    xs, total = x[0], sum(sizes)
    if w.size(1) != xs.size(1) or total > xs.size(0):
        raise OpInputError(
            f"{OP}: x {tuple(xs.shape)} and weight {tuple(w.shape)} disagree, or the groups "
            f"cover {total} rows"
        )
    y = xs.new_zeros(xs.size(0), w.size(2), dtype=torch.float32)
    start = 0
    for e, size in enumerate(sizes):  # one matmul per expert
        y[start : start + size] = xs[start : start + size].float() @ w[e].float()
        start += size
    return y.to(xs.dtype)


def _group_sizes(group_list: Tensor, group_list_type: int | None, num_groups: int) -> list[int]:
    if group_list.dim() != 1 or group_list.numel() != num_groups:
        raise OpInputError(
            f"{OP}: group_list must be 1-D with {num_groups} entries, got {describe(group_list)}"
        )
    require_dtype(OP, "group_list", group_list, (torch.int64,))
    values = [int(v) for v in group_list.tolist()]  # one host copy per call
    if group_list_type in (None, 0):
        sizes = [b - a for a, b in zip([0, *values[:-1]], values, strict=True)]
        if any(s < 0 for s in sizes) or values[0] < 0:
            raise OpInputError(f"{OP}: cumsum group_list must be non-negative and non-decreasing")
        return sizes
    if group_list_type != 1:
        raise OpInputError(
            f"{OP}: group_list_type must be 0 (cumsum) or 1 (count), got {group_list_type}"
        )
    if any(v < 0 for v in values) or num_groups == 1:
        raise OpInputError(f"{OP}: count group_list must be non-negative with more than one entry")
    return values
