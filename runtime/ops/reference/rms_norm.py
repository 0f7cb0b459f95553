"""RMS norm operators: torch_npu.npu_rms_norm and npu_add_rms_norm (torch_npu 2.13.0).

    rstd = 1 / sqrt(mean(x^2 over the gamma dims) + epsilon)
    y    = x * rstd * gamma

gamma covers the trailing dims of x (usually the hidden size), so the mean runs over the last
``gamma.dim()`` axes and ``rstd`` keeps x's shape with those axes set to 1.

NOTE: the products are computed in fp32 and cast once at the end. unconfirmed: where the device
rounds a bf16/fp16 result (after the normalisation or after the gamma multiply), and that
``rstd`` is always float32; both only move the last bit of low-precision outputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, OpInputError, describe, require_dtype, require_rank
from .graph_ops import capturable


def _rstd_shape(x: Tensor, gamma: Tensor) -> list[int]:
    return [*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim())]


def _rms_norm_fake(args: SimpleNamespace) -> tuple[Tensor, Tensor]:
    x = args.input
    return torch.empty_like(x), x.new_empty(_rstd_shape(x, args.gamma), dtype=torch.float32)


def _add_rms_norm_fake(args: SimpleNamespace) -> tuple[Tensor, Tensor, Tensor]:
    rstd = args.x1.new_empty(_rstd_shape(args.x1, args.gamma), dtype=torch.float32)
    return torch.empty_like(args.x1), rstd, torch.empty_like(args.x1)


def _check(op: str, x: Tensor, gamma: Tensor) -> None:
    # 参数说明 of npu_rms_norm: self float16/bfloat16/float32, 2-8 dims; gamma the same dtype
    require_dtype(op, "x", x, FLOAT_DTYPES)
    require_rank(op, "x", x, 2, 8)
    if gamma.dtype != x.dtype:
        raise OpInputError(f"{op}: `gamma` must have x's dtype {x.dtype}, got {gamma.dtype}")
    if gamma.dim() == 0 or gamma.dim() > x.dim() or gamma.shape != x.shape[x.dim() - gamma.dim() :]:
        raise OpInputError(
            f"{op}: `gamma` must match the trailing dims of x {tuple(x.shape)}, got {describe(gamma)}"
        )


def _normalise(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """(y in fp32, rstd in fp32) for fp32 ``x``."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + epsilon)
    return x * rstd * gamma.float(), rstd


@capturable("rms_norm", _rms_norm_fake)
def npu_rms_norm(input: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple[Tensor, Tensor]:  # noqa: A002
    """RMS norm of ``input`` scaled by ``gamma``.

    Returns:
        ``(y, rstd)``: y has input's shape and dtype; rstd (float32) has input's shape with the
        gamma dims set to 1.
    """
    _check("npu_rms_norm", input, gamma)
    y, rstd = _normalise(input.float(), gamma, epsilon)
    return y.to(input.dtype), rstd


@capturable("add_rms_norm", _add_rms_norm_fake)
def npu_add_rms_norm(
    x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-06
) -> tuple[Tensor, Tensor, Tensor]:
    """RMS norm of ``x1 + x2``, also returning the sum (the next residual).

    NOTE: the 2.13.0 wheel's ``_op_plugin_docs.py`` has no block for this operator; its dtype
    and rank limits are taken to be npu_rms_norm's, and x1, x2 must have one shape and dtype.

    Returns:
        ``(y, rstd, x)`` where ``x = x1 + x2`` in the inputs' dtype.
    """
    op = "npu_add_rms_norm"
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise OpInputError(f"{op}: x1 and x2 must match, got {describe(x1)} and {describe(x2)}")
    _check(op, x1, gamma)
    total = x1.float() + x2.float()
    y, rstd = _normalise(total, gamma, epsilon)
    return y.to(x1.dtype), rstd, total.to(x1.dtype)
