"""Cache byte arithmetic shared by the analyzer's memory plan and the runtime's allocator.

Sizes are computed from dtype names (``"bfloat16"``) so the analyzer needs no tensors; the
runtime passes ``str(torch_dtype)`` names through :func:`dtype_name`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

#: bytes per element of every dtype a cache may hold
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
}


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(dtype: object, default: int | None = None) -> int:
    """Bytes per element of ``dtype``; ``default`` when the name is unknown (else KeyError)."""
    name = dtype_name(dtype)
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    if default is None:
        raise KeyError(f"no element size known for dtype {name!r}")
    return default


def entry_bytes(dims: int | Iterable[int], num_head: int, element_bytes: int) -> int:
    """Bytes of one cache row: ``num_head`` heads of ``dims`` elements each.

    For an attention entry that is one token's K (or V) of one layer; for a state entry
    whose ``dims`` is its whole shape (``num_head`` 1) it is one request's state.
    """
    shape = [dims] if isinstance(dims, int) else list(dims)
    return math.prod(int(d) for d in shape) * int(num_head) * int(element_bytes)


def block_bytes(row_bytes: int, block_size: int, compress_ratio: int = 1) -> int:
    """Bytes one block of BLOCK_SIZE tokens holds of a cache with rows of ROW_BYTES.

    A row per token, or for a compressed cache one row per ``compress_ratio`` tokens:
    ``block_size // compress_ratio`` rows (the framework's ``storage_block_size``). Example: a
    512-wide bf16 row, 128-token blocks, ratio 4: 32 rows x 1,024 B = 32,768 B.
    """
    assert block_size % compress_ratio == 0, "a block holds whole compressed rows"
    return block_size // compress_ratio * row_bytes


def token_bytes(row_bytes: int, compress_ratio: int = 1) -> int:
    """Bytes one token adds to a cache: its row, or 1 / compress_ratio of a compressed row
    (rounded up when the ratio does not divide the row; blocks are priced exactly by
    :func:`block_bytes`)."""
    return -(-row_bytes // compress_ratio)


def hybrid_block_size(
    attention_bytes_per_token: int, state_page_bytes: int, kernel_block_size: int = 16
) -> int:
    """Smallest multiple of the kernel block size whose attention page holds a state page.

    A pool shared by attention and state groups pages both with one page size: the
    attention block size grows (in kernel blocks) until one attention page holds a whole
    per-request state, so a state never spans two pages and the attention padding stays
    below one kernel block. Example: 512 B/token of K+V, a 20 KiB state and kernel blocks of
    16 tokens give ceil(20480 / 8192) * 16 = 48 tokens per block.
    """
    per_kernel_block = attention_bytes_per_token * kernel_block_size
    return max(1, -(-state_page_bytes // per_kernel_block)) * kernel_block_size
