"""Version-neutral description of one fused-attention call, shared by its validation steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvskill.core import npu_limits
from torch import Tensor

#: side of the compressed causal tile that sparse modes 2/3/4 take (npu_ops.md §1.5)
COMPRESSED_MASK_SIZE = 2048
MLA_ROPE_DIM = npu_limits.MLA_ROPE_DIM
MLA_NOPE_DIMS = npu_limits.MLA_LATENT_DIMS
MAX_GQA_RATIO = 64
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


@dataclass(frozen=True, slots=True)
class Names:
    """The keyword names one operator version uses, for error messages."""

    op: str
    num_heads: str
    q_lens: str
    kv_lens: str
    scale: str


@dataclass(slots=True)
class FaCall:
    """One fused-attention call in version-neutral terms."""

    names: Names
    query: Tensor
    key: Tensor
    value: Tensor
    query_rope: Tensor | None
    key_rope: Tensor | None
    pse_shift: Tensor | None
    atten_mask: Tensor | None
    q_lens_arg: object
    kv_lens_arg: object
    block_table: Tensor | None
    num_heads: int
    num_key_value_heads: int
    scale: float
    pre_tokens: int
    next_tokens: int
    input_layout: str
    sparse_mode: int
    block_size: int
    inner_precise: int
    return_lse: bool
    learnable_sink: Tensor | None = None


@dataclass(frozen=True, slots=True)
class Shapes:
    """Per-request lengths resolved from the layout and the length arguments."""

    batch: int
    q_lens: list[int]
    kv_lens: list[int]
    decode_branch: bool
