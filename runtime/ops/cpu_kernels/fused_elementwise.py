"""RMSNorm, SiLU(gate) * up and rotary embedding through the compiled one-pass kernels
(``fused_elementwise.c``).

Each function returns its result, or None when the call is not one the kernel covers (not
fp32 on the CPU, a last dimension that is not contiguous, rows that are not two levels of
strides, kernels off); the caller then runs its PyTorch form. Results agree with PyTorch's to
within fp32 rounding (the sum of squares is added in another order, exp may differ in its last
two bits), not bit for bit; rope's are bit for bit.

Each kernel is also a registered custom operator (``torch.ops.kvskill.fused_rms_norm``,
``fused_silu_mul``, ``fused_rope``) with a fake implementation, so a captured decode step
(``runtime/captured_decode.py``) keeps it as one node instead of breaking its graph at the
``ctypes`` call; eager calls reach the kernel directly. Whether a call is covered is decided
from shapes and strides before either, which a trace knows.
"""

from __future__ import annotations

import ctypes

import torch
from kvskill.runtime.ops.reference.graph_ops import compiling, register
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
    if _row_layout(x) is None or not _kernels_loaded():
        return None
    return _RMS_NORM(x, weight, eps) if compiling() else _rms_norm(x, weight, eps)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    fn = _function("kvskill_rms_norm", [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _f32, _ptr, _i64])
    if fn is None:  # turned off since the call was found covered (a graph captured before)
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * (x * scale)
    out = torch.empty(x.shape, dtype=torch.float32)
    outer, inner, so, si = _row_layout(x)
    fn(x.data_ptr(), outer, inner, so, si, weight.data_ptr(), x.size(-1), eps, out.data_ptr(),
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
    if not _kernels_loaded():
        return None
    return _SILU_MUL(gate, up) if compiling() else _silu_mul(gate, up)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    fn = _function("kvskill_silu_mul", [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64])
    if fn is None:  # turned off since the call was found covered (a graph captured before)
        return torch.nn.functional.silu(gate) * up
    g_rows, u_rows = _row_layout(gate), _row_layout(up)
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
    # (the result is laid out as x, whose head dim is contiguous: so is the result's)
    if tokens == 0 or not _kernels_loaded():
        return None
    return _ROPE(x, cos, sin) if compiling() else _rope(x, cos, sin)


def _rope_output(x: Tensor) -> Tensor:
    """The result's tensor, laid out as x is."""
    return torch.empty_like(x, memory_format=torch.preserve_format)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    fn = _function(
        "kvskill_rope",
        [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64],
    )
    out = _rope_output(x)
    if fn is None:  # turned off since the call was found covered (a graph captured before)
        half = x.size(-1) // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        out.copy_(x * cos.view(1, 1, *cos.shape[-2:]) + rotated * sin.view(1, 1, *sin.shape[-2:]))
        return out
    _, heads, tokens, dim = x.shape
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


@torch.compiler.assume_constant_result
def _kernels_loaded() -> bool:
    """Whether the kernels are built and on; a trace takes the answer as a constant (it
    cannot follow the loading)."""
    return load("fused_elementwise") is not None


def _function(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    lib = load("fused_elementwise")  # None while kernels are off (build.disabled, env)
    if lib is None:
        return None
    fn = getattr(lib, name)  # ctypes caches this object on the library
    if fn.argtypes is None:
        fn.restype = None
        fn.argtypes = argtypes
    return fn


# The kernels as registered operators (see the module docstring); the fakes give the shapes
# and layouts the kernels return.
_RMS_NORM = register(
    "fused_rms_norm",
    _rms_norm,
    lambda x, weight, eps: torch.empty(x.shape, dtype=torch.float32, device=x.device),
)
_SILU_MUL = register(
    "fused_silu_mul",
    _silu_mul,
    lambda gate, up: torch.empty(gate.shape, dtype=torch.float32, device=gate.device),
)
_ROPE = register("fused_rope", _rope, lambda x, cos, sin: _rope_output(x))
