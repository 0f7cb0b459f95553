"""Decode attention over paged KV through the compiled kernel (``paged_decode.c``).

``paged_decode`` takes what the fused-attention reference has already validated and returns
the padded output ``[B, N, 1, Dv]`` in fp32, or None when the call is not one the kernel
covers (mixed or other dtypes, a cache form it does not walk, kernels off). The caller then
runs the PyTorch path, so None never changes a result. Like that path, the kernel computes in
fp32 whatever the input dtype (fp32 or bfloat16); the caller casts the output back.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .build import load

#: input dtypes the kernel reads (query, key and value alike); it computes in fp32
_DTYPES = (torch.float32, torch.bfloat16)

# Each thread gets at least this many cached key rows (summed over requests and kv heads).
# Built with OpenMP the kernel runs on torch's own (already awake) threads, so a second thread
# costs next to nothing to start. Measured on the 2-core AMD EPYC (idle, 16 heads over 8 kv
# heads of 128, fp32, one thread vs two): 2048 rows 0.092 / 0.057 ms, 20480 rows 0.98 / 0.49
# ms, 131072 rows 11.0 / 5.9 ms. The kernel is bound by reading the cache; a second core
# nearly doubles that. (Starting pthreads of its own instead cost about 0.1 ms per call, and in
# a decode step, beside torch's spinning OpenMP threads, made two threads slower than one.)
_KEY_ROWS_PER_THREAD = 1_024


class _Args(ctypes.Structure):
    # Field for field the C struct ``decode_args``.
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_sb", ctypes.c_int64),
        ("q_sn", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("k_sblk", ctypes.c_int64),
        ("k_srow", ctypes.c_int64),
        ("k_shead", ctypes.c_int64),
        ("v", ctypes.c_void_p),
        ("v_sblk", ctypes.c_int64),
        ("v_srow", ctypes.c_int64),
        ("v_shead", ctypes.c_int64),
        ("table", ctypes.c_void_p),
        ("table_sb", ctypes.c_int64),
        ("table_width", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("kv_lens", ctypes.c_void_p),
        ("batch", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("dim_v", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("out", ctypes.c_void_p),
        ("bf16", ctypes.c_int64),
        ("qr", ctypes.c_void_p),
        ("qr_sb", ctypes.c_int64),
        ("qr_sn", ctypes.c_int64),
        ("kr", ctypes.c_void_p),
        ("kr_sblk", ctypes.c_int64),
        ("kr_srow", ctypes.c_int64),
        ("kr_shead", ctypes.c_int64),
        ("dim_rope", ctypes.c_int64),
    ]


class BlockOutOfRangeError(RuntimeError):
    """A block table entry the kernel was about to read names no block of the cache."""

    def __init__(self, request: int, num_blocks: int) -> None:
        super().__init__(
            f"block_table row {request} names a block outside the cache's {num_blocks} blocks "
            f"within its first kv length tokens"
        )
        self.request = request


def paged_decode(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    kv_lens: list[int],
    num_kv_heads: int,
    scale: float,
    q_rope: Tensor | None = None,
    key_rope_cache: Tensor | None = None,
) -> Tensor | None:
    """Attention of one query row per request over its first kv_lens[b] paged tokens.

    Args:
        q: [B, N, 1, D] (any strides with a contiguous head dim), fp32 or bfloat16; the caches
            must have the same dtype.
        key_cache, value_cache: 3-D [num_blocks, block_size, KVN*D] or 4-D
            [num_blocks, KVN, block_size, D], contiguous in the head dim (page-pool views
            with a larger block stride are fine).
        block_table: int32 [B, max_blocks], validated to cover kv_lens.
        kv_lens: per request; 0 gives a zero output row.
        q_rope, key_rope_cache: absorbed MLA's rope parts ([B, N, 1, Dr] and a paged cache in
            one of the forms above with the key cache's blocks), added to every score.

    Returns:
        fp32 [B, N, 1, Dv], or None when this call is left to the PyTorch path.

    Raises:
        BlockOutOfRangeError: a block id the request needs is outside the cache.
    """
    if q.dtype not in _DTYPES or q.device.type != "cpu" or q.stride(-1) != 1:
        return None
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        return None
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        return None
    key = _cache_strides(key_cache, num_kv_heads)
    value = _cache_strides(value_cache, num_kv_heads)
    if key is None or value is None or key[4] != q.size(-1):
        return None
    if key_cache.size(0) != value_cache.size(0) or key[3] != value[3]:
        return None
    rope = _rope_args(q, q_rope, key_rope_cache, key_cache, key[3], num_kv_heads)
    if rope is None:
        return None
    fn = _kernel()
    if fn is None:
        return None
    batch, heads = q.size(0), q.size(1)
    lens = torch.tensor(kv_lens, dtype=torch.int64)
    out = torch.empty((batch, heads, 1, value[4]), dtype=torch.float32)
    args = _Args(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        key_cache.data_ptr(),
        *key[:3],
        value_cache.data_ptr(),
        *value[:3],
        block_table.data_ptr(),
        block_table.stride(0),
        block_table.size(1),
        key_cache.size(0),
        key[3],
        lens.data_ptr(),
        batch,
        heads,
        num_kv_heads,
        key[4],
        value[4],
        scale,
        out.data_ptr(),
        q.dtype == torch.bfloat16,
        *rope,
    )
    key_rows = sum(kv_lens) * num_kv_heads
    threads = max(1, min(torch.get_num_threads(), key_rows // _KEY_ROWS_PER_THREAD))
    code = fn(ctypes.byref(args), threads)
    if code < 0:
        raise MemoryError("paged decode kernel: out of memory for its score buffers")
    if code > 0:
        raise BlockOutOfRangeError(code - 1, key_cache.size(0))
    return out


_NO_ROPE = (None, 0, 0, None, 0, 0, 0, 0)


def _rope_args(
    q: Tensor,
    q_rope: Tensor | None,
    key_rope_cache: Tensor | None,
    key_cache: Tensor,
    block_size: int,
    num_kv_heads: int,
) -> tuple | None:
    """The rope fields of the C arguments (zeros without rope), or None if not walkable."""
    if q_rope is None and key_rope_cache is None:
        return _NO_ROPE
    if q_rope is None or key_rope_cache is None:
        return None
    if q_rope.dtype != q.dtype or key_rope_cache.dtype != q.dtype or q_rope.stride(-1) != 1:
        return None
    strides = _cache_strides(key_rope_cache, num_kv_heads)
    if strides is None or strides[3] != block_size or strides[4] != q_rope.size(-1):
        return None
    if key_rope_cache.size(0) != key_cache.size(0) or q_rope.shape[:3] != q.shape[:3]:
        return None
    return (
        q_rope.data_ptr(),
        q_rope.stride(0),
        q_rope.stride(1),
        key_rope_cache.data_ptr(),
        *strides[:3],
        strides[4],
    )


def _cache_strides(cache: Tensor, num_kv_heads: int) -> tuple[int, int, int, int, int] | None:
    """(block, row, head) strides in elements, block size and head dim; None if not walkable."""
    if cache.device.type != "cpu" or cache.stride(-1) != 1:
        return None
    if cache.dim() == 3:
        if cache.size(2) % num_kv_heads:
            return None
        dim = cache.size(2) // num_kv_heads
        return cache.stride(0), cache.stride(1), dim, cache.size(1), dim
    if cache.dim() == 4 and cache.size(1) == num_kv_heads:
        return cache.stride(0), cache.stride(2), cache.stride(1), cache.size(2), cache.size(3)
    return None


def _kernel():
    """The bound C entry point, or None when kernels are off or unavailable."""
    lib = load("paged_decode")
    if lib is None:
        return None
    fn = lib.kvskill_paged_decode  # ctypes caches this object on the library
    if fn.restype is not ctypes.c_int64:
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_int64]
    return fn
