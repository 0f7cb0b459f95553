"""RMSNorm, SiLU(gate) * up and rotary embedding through the compiled one-pass kernels
(``fused_elementwise.c``).

Each function returns its result, or None when the call is not one the kernel covers (not
fp32 on the CPU, a last dimension that is not contiguous, rows that are not two levels of
strides, kernels off); the caller then runs its PyTorch form. Results agree with PyTorch's to
within fp32 rounding (the sum of squares is added in another order, exp may differ in its last
two bits), not bit for bit; rope's are bit for bit.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .build import load

# Each thread gets at least this many elements: below it, waking the second thread costs
# more than the pass (ATen's own elementwise grain size is 32768 too). SiLU's exp makes an
# element cost several times more, so it splits sooner: at 16 x 3072 elements one thread
# took 44 us and PyTorch's two 42 (benchmarks/bench_fused_layers.py).
_ELEMENTS_PER_THREAD = 32_768
_SILU_ELEMENTS_PER_THREAD = 8_192

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """``weight * (x * rsqrt(mean(x**2, -1) + eps))`` over the last dimension, or None."""
    if not _fp32_cpu(x, weight) or weight.dim() != 1 or weight.stride(0) != 1:
        return None
    dim = x.size(-1)
    if weight.size(0) != dim or dim == 0:
        return None
    rows = _row_layout(x)
    fn = _function("kvskill_rms_norm", [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _f32, _ptr, _i64])
    if rows is None or fn is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    outer, inner, so, si = rows
    fn(x.data_ptr(), outer, inner, so, si, weight.data_ptr(), dim, eps, out.data_ptr(),
       _threads(out.numel(), _ELEMENTS_PER_THREAD))  # fmt: skip
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor | None:
    """``silu(gate) * up`` for two tensors of one shape whose rows may be strided, or None."""
    if not _fp32_cpu(gate, up) or gate.shape != up.shape or gate.dim() == 0:
        return None
    g_rows, u_rows = _row_layout(gate), _row_layout(up)
    # one stride between rows: the kernel walks rows, not [outer, inner] pairs
    if g_rows is None or u_rows is None or g_rows[1] != 1 or u_rows[1] != 1:
        return None
    fn = _function("kvskill_silu_mul", [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64])
    if fn is None:
        return None
    out = torch.empty(gate.shape, dtype=torch.float32)
    fn(gate.data_ptr(), g_rows[2], up.data_ptr(), u_rows[2], g_rows[0], gate.size(-1),
       out.data_ptr(), _threads(out.numel(), _SILU_ELEMENTS_PER_THREAD))  # fmt: skip
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """``x * cos + rotate_half(x) * sin`` for x [1, H, T, D] and cos, sin [1, T, D] or [T, D]
    (one angle per token, shared by the heads), or None.

    The result is laid out as x is (``empty_like``), as PyTorch's own elementwise passes lay
    out theirs: for the transposed views models pass (``q.view(..).transpose(1, 2)``) the
    memory of a contiguous [1, T, H, D], so the model's later ``transpose(1, 2).reshape(T,
    H, D)`` is a view, not a copy; for a contiguous x a contiguous result, which model code
    may ``view`` as it likes.
    """
    if not _fp32_cpu(x, cos, sin) or x.dim() != 4 or x.size(0) != 1 or x.size(-1) % 2:
        return None
    _, heads, tokens, dim = x.shape
    if cos.shape != sin.shape or cos.shape[-2:] != (tokens, dim) or cos.numel() != tokens * dim:
        return None
    fn = _function(
        "kvskill_rope",
        [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64],
    )
    if fn is None or tokens == 0:
        return None
    out = torch.empty_like(x, memory_format=torch.preserve_format)
    if out.stride(-1) != 1:
        return None
    fn(x.data_ptr(), tokens, heads, x.stride(2), x.stride(1), dim, cos.data_ptr(),
       cos.stride(-2), sin.data_ptr(), sin.stride(-2), out.data_ptr(), out.stride(2),
       out.stride(1), _threads(out.numel(), _ELEMENTS_PER_THREAD))  # fmt: skip
    return out


def _fp32_cpu(*tensors: Tensor) -> bool:
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors
    )


def _row_layout(x: Tensor) -> tuple[int, int, int, int] | None:
    """(outer, inner, outer stride, inner stride) addressing every row of ``x`` ([..., D]
    with a contiguous last dim), or None when its leading dims need more than two strides."""
    levels: list[list[int]] = []  # [size, stride], outermost first
    for size, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True):
        if size == 1:
            continue
        if levels and levels[-1][1] == size * stride:
            levels[-1] = [levels[-1][0] * size, stride]  # collapses into the level above
        else:
            levels.append([size, stride])
    if not levels:
        return 1, 1, 0, 0
    if len(levels) == 1:
        return levels[0][0], 1, levels[0][1], 0
    if len(levels) == 2:
        return levels[0][0], levels[1][0], levels[0][1], levels[1][1]
    return None


def _threads(elements: int, per_thread: int) -> int:
    return max(1, min(torch.get_num_threads(), elements // per_thread))


def _function(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    lib = load("fused_elementwise")  # None while kernels are off (build.disabled, env)
    if lib is None:
        return None
    fn = getattr(lib, name)  # ctypes caches this object on the library
    if fn.argtypes is None:
        fn.restype = None
        fn.argtypes = argtypes
    return fn
