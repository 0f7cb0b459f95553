"""custom.npu_sparse_attn_sharedkv_metadata: the tiling plan npu_sparse_attn_sharedkv reads.

On the device this AICPU operator splits the attention of one layer kind into per-core tasks
(SAS metadata doc:332, "生成一个任务列表"), a ``[1024]`` int32 tensor the attention requires
(SAS doc:55, "目前为必传参数"). The split itself is hardware scheduling the reference does not
model: the reference writes the arguments the plan was made for into its first words, and the
attention refuses a plan made for another call (other heads, dim, ratio, top-k, or with / without
the compressed cache), the mistake a converted model can make when it shares one plan between
layer kinds. NOTE: whether the device detects such a mismatch or computes garbage is
unconfirmed; the reference refuses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import strict_keywords
from .limits import (
    CMP_MASK_MODE,
    METADATA_WORDS,
    ORI_MASK_MODE,
    ORI_WIN_LEFT,
    ORI_WIN_RIGHT,
    SAS_KV_HEADS,
    SAS_LAYOUT_KV,
    SAS_LAYOUTS_Q,
    check_cmp_ratio,
    check_dims,
    check_int32,
    check_only_default,
    check_topk,
    check_unset,
    fail,
)

OP = "npu_sparse_attn_sharedkv_metadata"
#: what the reference records, in this order, at the front of the plan
FIELDS = (
    "num_heads_q",
    "num_heads_kv",
    "head_dim",
    "cmp_topk",
    "cmp_ratio",
    "has_ori_kv",
    "has_cmp_kv",
)


@strict_keywords(OP, {"topk": "the compressed top-k is `cmp_topk`"})
def npu_sparse_attn_sharedkv_metadata(
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_ori_kv: Tensor | None = None,
    cu_seqlens_cmp_kv: Tensor | None = None,
    seqused_q: Tensor | None = None,
    seqused_kv: Tensor | None = None,
    batch_size: int = 0,
    max_seqlen_q: int = 0,
    max_seqlen_kv: int = 0,
    ori_topk: int = 0,
    cmp_topk: int = 0,
    cmp_ratio: int = -1,
    ori_mask_mode: int = 4,
    cmp_mask_mode: int = 3,
    ori_win_left: int = 127,
    ori_win_right: int = 0,
    layout_q: str = "BSND",
    layout_kv: str = "PA_ND",
    has_ori_kv: bool = True,
    has_cmp_kv: bool = True,
    device: str = "npu:0",
) -> Tensor:
    """A ``[1024]`` int32 plan for npu_sparse_attn_sharedkv calls with these arguments."""
    check_only_default(
        OP,
        ori_mask_mode=(ori_mask_mode, ORI_MASK_MODE),
        cmp_mask_mode=(cmp_mask_mode, CMP_MASK_MODE),
        ori_win_left=(ori_win_left, ORI_WIN_LEFT),
        ori_win_right=(ori_win_right, ORI_WIN_RIGHT),
        layout_kv=(layout_kv, SAS_LAYOUT_KV),
        ori_topk=(ori_topk, 0),  # SAS metadata doc:368 "目前暂不支持指定该参数"
    )
    if layout_q not in SAS_LAYOUTS_Q:
        fail(OP, f"layout_q must be one of {list(SAS_LAYOUTS_Q)}, got {layout_q!r}")
    # SAS metadata doc:358 "seqused_q ... 目前暂不支持指定该参数"; :354/356 the cu_seqlens of
    # the caches have no effect with PA_ND
    check_unset(OP, "not supported by the operator yet", seqused_q=seqused_q)
    check_unset(
        OP,
        "layout_kv 'PA_ND' ignores it",
        cu_seqlens_ori_kv=cu_seqlens_ori_kv,
        cu_seqlens_cmp_kv=cu_seqlens_cmp_kv,
    )
    check_int32(OP, "cu_seqlens_q", cu_seqlens_q, 1)
    check_int32(OP, "seqused_kv", seqused_kv, 1)
    # SAS metadata doc:400 "Tensor不能全传None"
    if cu_seqlens_q is None and seqused_kv is None:
        fail(OP, "pass cu_seqlens_q or seqused_kv: the tensors must not all be None")
    if layout_q == "TND" and cu_seqlens_q is None:
        fail(OP, "layout_q 'TND' requires cu_seqlens_q")
    if num_heads_kv != SAS_KV_HEADS:
        fail(OP, f"num_heads_kv must be {SAS_KV_HEADS}, got {num_heads_kv}")
    if not has_ori_kv:
        # SAS doc:84: every documented scenario passes ori_kv
        fail(OP, "has_ori_kv=False is none of the operator's scenarios (ori_kv is always passed)")
    check_dims(OP, heads=num_heads_q, head_dim=head_dim)
    if has_cmp_kv:
        check_cmp_ratio(OP, cmp_ratio)
        if cmp_topk:
            check_topk(OP, cmp_topk)
    values = {
        "num_heads_q": num_heads_q,
        "num_heads_kv": num_heads_kv,
        "head_dim": head_dim,
        "cmp_topk": cmp_topk if has_cmp_kv else 0,
        "cmp_ratio": cmp_ratio if has_cmp_kv else 0,
        "has_ori_kv": int(has_ori_kv),
        "has_cmp_kv": int(has_cmp_kv),
    }
    where = cu_seqlens_q if cu_seqlens_q is not None else seqused_kv
    plan = torch.zeros(METADATA_WORDS, dtype=torch.int32, device=where.device)
    plan[: len(FIELDS)] = torch.tensor([values[f] for f in FIELDS], dtype=torch.int32)
    return plan


def check_plan(op: str, metadata: Tensor | None, **call: int) -> None:
    """Refuse a plan made for another call; CALL names a subset of FIELDS."""
    if metadata is None:
        fail(op, "`metadata` is required (from npu_sparse_attn_sharedkv_metadata)")
    if (
        not isinstance(metadata, Tensor)
        or metadata.dtype != torch.int32
        or tuple(metadata.shape) != (METADATA_WORDS,)
    ):
        fail(op, f"`metadata` must be an int32 tensor of shape [{METADATA_WORDS}]")
    recorded = dict(zip(FIELDS, metadata[: len(FIELDS)].tolist(), strict=True))
    for name, value in call.items():
        if recorded[name] != value:
            fail(
                op,
                f"`metadata` was made for {name}={recorded[name]} but this call has {value}; "
                "call npu_sparse_attn_sharedkv_metadata with this layer's arguments",
            )
