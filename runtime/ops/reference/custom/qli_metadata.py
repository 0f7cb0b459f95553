"""custom.npu_quant_lightning_indexer_metadata: the plan npu_quant_lightning_indexer may read.

On the device an AICPU operator splits the indexer into per-core tasks (QLI metadata doc:10);
the reference's plan records the call's arguments instead (``plans.py``). The schema defaults
``layout_key`` to 'BSND', yet the doc (QLI metadata doc:50) supports only 'PA_BSND': the
reference refuses anything else, the default included.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import strict_keywords
from ..npu_limits import NPU_ONLY
from ..npu_profile import current_profile
from ..sparse_limits import UNBOUNDED_TOKENS
from .limits import (
    MAX_SPARSE_COUNT,
    QLI_CMP_RATIOS,
    QLI_QUERY_HEADS,
    check_int32,
    check_only_default,
    fail,
)
from .plans import check_plan as _check_plan
from .plans import write_plan

OP = "npu_quant_lightning_indexer_metadata"
FIELDS = ("num_heads_q", "num_heads_k", "head_dim", "sparse_count", "sparse_mode", "cmp_ratio")


@strict_keywords(OP, {"topk": "the number kept is `sparse_count`"})
def npu_quant_lightning_indexer_metadata(
    num_heads_q: int,
    num_heads_k: int,
    head_dim: int,
    query_quant_mode: int,
    key_quant_mode: int,
    *,
    actual_seq_lengths_query: Tensor | None = None,
    actual_seq_lengths_key: Tensor | None = None,
    batch_size: int = 0,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = 9223372036854775807,
    next_tokens: int = 9223372036854775807,
    cmp_ratio: int = 1,
    device: str = "npu:0",
) -> Tensor:
    """A ``[1024]`` int32 plan for npu_quant_lightning_indexer calls with these arguments."""
    check_only_default(
        OP,
        query_quant_mode=(query_quant_mode, 0),  # QLI metadata doc:30/32 "当前仅支持传入0"
        key_quant_mode=(key_quant_mode, 0),
        layout_key=(layout_key, "PA_BSND"),
        num_heads_k=(num_heads_k, 1),  # QLI metadata doc:26 "目前仅支持1"
        pre_tokens=(pre_tokens, UNBOUNDED_TOKENS),
        next_tokens=(next_tokens, UNBOUNDED_TOKENS),
    )
    if layout_query not in ("BSND", "TND"):
        fail(OP, f"layout_query must be 'BSND' or 'TND', got {layout_query!r}")
    if not 1 <= sparse_count <= MAX_SPARSE_COUNT or sparse_mode not in (0, 3):
        fail(OP, f"sparse_count must be in [1, {MAX_SPARSE_COUNT}] and sparse_mode 0 or 3, got {sparse_count}, {sparse_mode}")  # fmt: skip
    if cmp_ratio not in QLI_CMP_RATIOS:
        fail(OP, f"cmp_ratio must be one of {list(QLI_CMP_RATIOS)}, got {cmp_ratio}")
    if current_profile().dims and num_heads_q != QLI_QUERY_HEADS:
        fail(OP, f"num_heads_q must be {QLI_QUERY_HEADS}, got {num_heads_q} ({NPU_ONLY})")
    check_int32(OP, "actual_seq_lengths_query", actual_seq_lengths_query, 1)
    check_int32(OP, "actual_seq_lengths_key", actual_seq_lengths_key, 1)
    values = {
        "num_heads_q": num_heads_q, "num_heads_k": num_heads_k, "head_dim": head_dim,
        "sparse_count": sparse_count, "sparse_mode": sparse_mode, "cmp_ratio": cmp_ratio,
    }  # fmt: skip
    given = (
        actual_seq_lengths_key if actual_seq_lengths_key is not None else actual_seq_lengths_query
    )
    return write_plan(FIELDS, values, given.device if given is not None else torch.device("cpu"))


def check_plan(op: str, metadata: Tensor, **call: int) -> None:
    _check_plan(op, OP, metadata, FIELDS, **call)
