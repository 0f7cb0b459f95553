"""SwiGLU activation: torch_npu.npu_swiglu (torch_npu 2.13.0).

    A, B = x split in two halves along ``dim``;  out = A * sigmoid(A) * B

Computed in fp32, returned in x's dtype; ``out`` has x's shape with ``dim`` halved.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, OpInputError, describe, require_dtype, require_rank
from .graph_ops import capturable


def _swiglu_fake(args: SimpleNamespace) -> Tensor:
    shape = list(args.input.shape)
    shape[args.dim] //= 2
    return args.input.new_empty(shape)


@capturable("swiglu", _swiglu_fake)
def npu_swiglu(input: Tensor, dim: int = -1) -> Tensor:  # noqa: A002
    """SwiGLU of ``input`` (1-D to 8-D, float16/bfloat16/float32) split along ``dim``."""
    op = "npu_swiglu"
    require_dtype(op, "x", input, FLOAT_DTYPES)
    require_rank(op, "x", input, 1, 8)
    if not -input.dim() <= dim < input.dim() or input.size(dim) % 2:
        raise OpInputError(f"{op}: dim {dim} must name an axis of even size, got {describe(input)}")
    gate, up = input.float().chunk(2, dim=dim)
    return (gate * torch.sigmoid(gate) * up).to(input.dtype)
