"""Interleaved-input, rotate-half-output rope: torch_npu.npu_interleave_rope.

For x with even last dim D, pairs (x[2m], x[2m+1]) are the rotated coordinates; the result is
written de-interleaved (first half the even lanes, second half the odd lanes):

    a = cat(x[0::2], x[1::2]);  b = cat(-x[1::2], x[0::2]);  out = a * cos + b * sin

The same rotation is applied to the rope channels inside ``npu_kv_rmsnorm_rope_cache``, so a
query rotated here matches keys cached there. unconfirmed: that the device versions of the two
operators are bit-identical.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ._checks import OpInputError, describe
from .graph_ops import capturable


def interleaved_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotation in fp32 (result fp32); cos/sin broadcast against x."""
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    a = _cat(even, odd)
    b = _cat(-odd, even)
    return a * cos.float() + b * sin.float()


def _cat(left: Tensor, right: Tensor) -> Tensor:
    return torch.cat((left, right), dim=-1)


def _interleave_rope_fake(args: SimpleNamespace) -> Tensor:
    return torch.empty_like(args.x)


@capturable("interleave_rope", _interleave_rope_fake)
def npu_interleave_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rope of ``x`` [B, N, S, D] with ``cos``/``sin`` broadcastable to it; returns x's dtype."""
    if x.dim() != 4 or x.size(-1) % 2:
        raise OpInputError(
            f"npu_interleave_rope: x must be 4-D [B, N, S, D] with even D, got {describe(x)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 4 or t.size(-1) != x.size(-1):
            raise OpInputError(
                f"npu_interleave_rope: {name} must be 4-D with last dim {x.size(-1)}, got "
                f"{describe(t)}"
            )
    return interleaved_rope(x, cos, sin).to(x.dtype)
