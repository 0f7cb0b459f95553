"""Documented limits of the DSA operators: npu_lightning_indexer, npu_sparse_flash_attention.

Sources, quoted in each check: the torch_npu 2.13.0 wheel's ``torch_npu/_op_plugin_docs.py``
(参数说明, "wheel doc") and the operators' pages in hicann/ops-transformer
(``attention/lightning_indexer/README.md``, ``attention/sparse_flash_attention/README.md``,
约束说明, "kernel doc"), which list the shape limits the wheel's page leaves out. Where the
two name different products, the Atlas A2/A3 limits are kept (the devices the framework
targets). Checks marked with ``NPU_ONLY`` run only when the NPU profile enforces their kind
(``npu_profile``): ``dims`` for head counts and dims (verify's shrunk twin changes them),
``dtypes`` for fp16/bf16, ``shapes`` for block sizes and int32 index tensors.
"""

from __future__ import annotations

import torch
from kvskill.core.npu_limits import (
    INDEXER_HEAD_DIM,
    INDEXER_MAX_QUERY_HEADS,
    SFA_QUERY_HEADS,
    SPARSE_COUNT_EXTRA,
    SPARSE_COUNT_MAX_RANGE,
    sparse_count_allowed,
)
from kvskill.core.npu_limits import SFA_LATENT_DIM as LATENT_DIM
from kvskill.core.npu_limits import SPARSE_BLOCK_MULTIPLE as BLOCK_MULTIPLE
from kvskill.core.npu_limits import SPARSE_MAX_BLOCK_SIZE as MAX_BLOCK_SIZE
from torch import Tensor

from ._checks import OpInputError, describe
from .npu_limits import NPU_ONLY, require_npu_dtype
from .npu_profile import current_profile

#: wheel doc, sparse_mode: "支持0/3" (both operators)
SPARSE_MODES = (0, 3)
#: schema default of pre_tokens / next_tokens; kernel docs: "仅支持默认值2^63-1"
UNBOUNDED_TOKENS = 9223372036854775807
#: kernel docs: "K_N仅支持1" / "KV_N仅支持1"
KEY_HEADS = 1
#: attention kernel doc: "... Dr值相等为64" (the latent, query heads and block sizes: core)
ROPE_DIM = 64
#: attention kernel doc, A2/A3: "sparse_block_size支持[1,128]，且要求是2的幂次方"
MAX_SPARSE_BLOCK = 128
#: attention kernel doc: "attention_mode ... 仅支持传入2，表示MLA-absorb模式"
MLA_ABSORB_MODE = 2

_HALF = (torch.float16, torch.bfloat16)
_INT32 = (torch.int32,)


def check_common(op: str, *, sparse_mode: int, pre_tokens: int, next_tokens: int) -> None:
    if sparse_mode not in SPARSE_MODES:
        raise OpInputError(
            f"{op}: sparse_mode must be 0 (all keys) or 3 (rightDownCausal), got {sparse_mode}"
        )
    if pre_tokens != UNBOUNDED_TOKENS or next_tokens != UNBOUNDED_TOKENS:
        raise OpInputError(
            f"{op}: pre_tokens/next_tokens take only their default 2^63-1, got "
            f"pre_tokens={pre_tokens}, next_tokens={next_tokens}"
        )


def check_sparse_count(op: str, sparse_count: int) -> None:
    if not sparse_count_allowed(sparse_count):
        raise OpInputError(
            f"{op}: sparse_count must be in 1..{SPARSE_COUNT_MAX_RANGE} or one of "
            f"{list(SPARSE_COUNT_EXTRA)}, got {sparse_count}"
        )


def check_key_heads(op: str, name: str, t: Tensor) -> None:
    heads = t.size(-2)
    if heads != KEY_HEADS:
        raise OpInputError(f"{op}: `{name}` must have {KEY_HEADS} head (N axis), got {describe(t)}")


def check_same_dtype(op: str, **tensors: Tensor | None) -> None:
    """Kernel docs: "参数query、key(、value)的数据类型应保持一致"."""
    given = {name: t.dtype for name, t in tensors.items() if t is not None}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{n}={str(d).removeprefix('torch.')}" for n, d in given.items())
        raise OpInputError(f"{op}: these inputs must share one dtype, got {listed}")


def check_half(op: str, **tensors: Tensor | None) -> None:
    """Wheel doc: "数据类型支持bfloat16和float16" (fp32 is a CPU-only convenience)."""
    for name, t in tensors.items():
        require_npu_dtype(op, name, t, _HALF)


def check_index_tensor(op: str, name: str, t: Tensor | None) -> None:
    """Index and length tensors: integer always, int32 on the NPU (wheel doc: "int32")."""
    if t is None:
        return
    if not isinstance(t, Tensor):
        # the schema types these `Tensor?`: a list (as the fused attention's SymInt[] lengths
        # take) does not bind
        raise TypeError(f"{op}(): `{name}` must be a 1-D int32 tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.dtype == torch.bool:
        raise OpInputError(f"{op}: `{name}` must be an int32 tensor, got {describe(t)}")
    if current_profile().shapes and t.dtype not in _INT32:
        raise OpInputError(f"{op}: `{name}` must be int32 on the NPU, got {t.dtype} ({NPU_ONLY})")


def check_paged_block_size(op: str, block_size: int) -> None:
    if not current_profile().shapes:
        return
    if block_size % BLOCK_MULTIPLE or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise OpInputError(
            f"{op}: paged block_size must be a multiple of {BLOCK_MULTIPLE} up to "
            f"{MAX_BLOCK_SIZE}, got {block_size} ({NPU_ONLY})"
        )


def check_indexer_dims(op: str, query: Tensor) -> None:
    heads, dim = query.size(-2), query.size(-1)
    if not current_profile().dims:
        return
    if dim != INDEXER_HEAD_DIM or heads > INDEXER_MAX_QUERY_HEADS:
        raise OpInputError(
            f"{op}: query must have head dim {INDEXER_HEAD_DIM} and at most "
            f"{INDEXER_MAX_QUERY_HEADS} heads, got {describe(query)} ({NPU_ONLY})"
        )


def check_attention_dims(op: str, query: Tensor, query_rope: Tensor) -> None:
    if not current_profile().dims:
        return
    heads = query.size(-2)
    if query.size(-1) != LATENT_DIM or query_rope.size(-1) != ROPE_DIM:
        raise OpInputError(
            f"{op}: query head dim must be {LATENT_DIM} and query_rope's {ROPE_DIM}, got "
            f"{query.size(-1)} and {query_rope.size(-1)} ({NPU_ONLY})"
        )
    if heads not in SFA_QUERY_HEADS:
        raise OpInputError(
            f"{op}: query heads must be one of {list(SFA_QUERY_HEADS)}, got {heads} ({NPU_ONLY})"
        )


def check_sparse_block_size(op: str, sparse_block_size: int, block_size: int | None) -> None:
    """Kernel doc, A2/A3: a power of two in [1, 128]; "在PageAttention场景下要求sparse_block_size
    整除block_size"."""
    sbs = sparse_block_size
    if not 1 <= sbs <= MAX_SPARSE_BLOCK or sbs & (sbs - 1):
        raise OpInputError(
            f"{op}: sparse_block_size must be a power of two in [1, {MAX_SPARSE_BLOCK}], got {sbs}"
        )
    if block_size is not None and block_size % sbs:
        raise OpInputError(
            f"{op}: sparse_block_size={sbs} must divide the paged block_size {block_size}"
        )
