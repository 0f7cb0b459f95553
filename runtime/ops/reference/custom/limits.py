"""Documented limits of the framework's custom operators (cann-recipes-infer ``fbc225d``).

Sources: ``ops/ascendc/docs/custom-npu_sparse_attn_sharedkv.md`` ("SAS doc"),
``custom-npu_sparse_attn_sharedkv_metadata.md`` ("SAS metadata doc") and
``custom-npu_compressor.md`` ("compressor doc"), each quoted by line. As for the torch_npu
operators (``../sparse_limits.py``), a limit that a correct conversion of a shrunk model breaks
on purpose runs only when the NPU profile enforces its kind: ``dims`` (head counts, head dims,
top-k widths), ``dtypes`` (fp16/bf16), ``shapes`` (paged block sizes); every other documented
constraint is always checked.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import OpInputError, describe
from ..npu_limits import NPU_ONLY, require_npu_dtype
from ..npu_profile import current_profile

#: SAS doc:27 "N1仅支持64"; SAS metadata doc:344 "num_heads_q ... 目前仅支持64"
SAS_QUERY_HEADS = 64
#: SAS doc:31 "KV_N仅支持1"; SAS metadata doc:346
SAS_KV_HEADS = 1
#: SAS doc:85 "参数q中的D和ori_kv、cmp_kv的D值相等为512"
SAS_HEAD_DIM = 512
#: SAS doc:37 "K2仅支持512"; SAS metadata doc:370 "cmp_topk ... 目前仅支持512"
SAS_CMP_TOPK = 512
#: SAS doc:59 / compressor doc:141 "cmp_ratio ... 支持4/128"
CMP_RATIOS = (4, 128)
#: SAS doc:61-67: each mask argument "仅支持输入默认值"
ORI_MASK_MODE = 4  # band
CMP_MASK_MODE = 3  # rightDownCausal
ORI_WIN_LEFT = 127
ORI_WIN_RIGHT = 0
#: SAS doc:31/33 "block_size取值为16的倍数，最大支持1024"
BLOCK_MULTIPLE = 16
MAX_BLOCK_SIZE = 1024
#: SAS doc:55 "shape固定为[1024]"
METADATA_WORDS = 1024
#: SAS doc:69, 71
SAS_LAYOUTS_Q = ("BSND", "TND")
SAS_LAYOUT_KV = "PA_ND"

HALF = (torch.float16, torch.bfloat16)


def fail(op: str, message: str) -> None:
    raise OpInputError(f"{op}: {message}")


def check_only_default(op: str, **given: tuple[object, object]) -> None:
    """Arguments whose doc says "仅支持默认值": name=(value, the one value accepted)."""
    for name, (value, allowed) in given.items():
        if value != allowed:
            fail(op, f"{name} takes only {allowed!r}, got {value!r}")


def check_unset(op: str, reason: str, **tensors: object) -> None:
    """Arguments the doc says are not supported yet (setting them has no effect on device)."""
    for name, value in tensors.items():
        if value is not None and value is not False:
            fail(op, f"`{name}` must be left unset: {reason}, got {describe(value)}")


def check_cmp_ratio(op: str, cmp_ratio: int) -> None:
    if cmp_ratio not in CMP_RATIOS:
        fail(op, f"cmp_ratio must be one of {list(CMP_RATIOS)}, got {cmp_ratio}")


def check_half(op: str, **tensors: Tensor | None) -> None:
    """fp16/bf16 on the device (fp32 is a CPU-only convenience)."""
    for name, t in tensors.items():
        require_npu_dtype(op, name, t, HALF)


def check_int32(op: str, name: str, t: Tensor | None, rank: int) -> None:
    """An index or length tensor: integer of the given rank always, int32 on the device."""
    if t is None:
        return
    if not isinstance(t, Tensor) or t.is_floating_point() or t.dtype == torch.bool:
        fail(op, f"`{name}` must be an int32 tensor, got {describe(t)}")
    if t.dim() != rank:
        fail(op, f"`{name}` must be {rank}-D, got {describe(t)}")
    if current_profile().shapes and t.dtype != torch.int32:
        fail(op, f"`{name}` must be int32 on the NPU, got {t.dtype} ({NPU_ONLY})")


def check_paged_cache(op: str, name: str, cache: Tensor) -> None:
    """SAS doc:31/33: ``[block_num, block_size, KV_N, D]``, KV_N 1, block_size 16k <= 1024."""
    if cache.dim() != 4:
        fail(op, f"`{name}` must be 4-D [block_num, block_size, KV_N, D], got {describe(cache)}")
    if cache.size(2) != SAS_KV_HEADS:
        fail(op, f"`{name}` must have {SAS_KV_HEADS} KV head, got {describe(cache)}")
    block_size = cache.size(1)
    bad = block_size % BLOCK_MULTIPLE or not 0 < block_size <= MAX_BLOCK_SIZE
    if current_profile().shapes and bad:
        fail(
            op,
            f"`{name}` block_size must be a multiple of {BLOCK_MULTIPLE} up to "
            f"{MAX_BLOCK_SIZE}, got {block_size} ({NPU_ONLY})",
        )


def check_dims(op: str, *, heads: int, head_dim: int) -> None:
    if not current_profile().dims:
        return
    if heads != SAS_QUERY_HEADS or head_dim != SAS_HEAD_DIM:
        fail(
            op,
            f"q must have {SAS_QUERY_HEADS} heads of dim {SAS_HEAD_DIM}, got {heads} heads of "
            f"dim {head_dim} ({NPU_ONLY})",
        )


def check_topk(op: str, topk: int) -> None:
    if current_profile().dims and topk != SAS_CMP_TOPK:
        fail(op, f"the compressed top-k must be {SAS_CMP_TOPK}, got {topk} ({NPU_ONLY})")


def cu_seqlens_lengths(op: str, name: str, cu: Tensor) -> list[int]:
    """Per-request lengths of a prefix-sum tensor (first element 0, never decreasing)."""
    values = [int(v) for v in cu.tolist()]
    if not values or values[0] != 0:
        fail(op, f"`{name}` must start with 0 (a prefix sum), got {values[:4]}")
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    if any(n < 0 for n in lengths):
        fail(op, f"`{name}` must never decrease (a prefix sum), got {values}")
    return lengths
