"""Expert-parallel token dispatch and combine at one rank: torch_npu.npu_moe_distribute_dispatch_v2
and npu_moe_distribute_combine_v2 (torch_npu 2.13.0 schemas), unquantized.

On the device the pair routes each token's top-K copies to the ranks holding their experts
(an all-to-all over the EP group, ``group_ep``) and back. A CPU run is one process, so the
reference models exactly one rank (``ep_world_size`` 1, no TP domain), where the all-to-all
is the identity and the pair reduces to a local sort by expert and its weighted inverse.
Any other world size is refused by name (it communicates between NPUs).

Worked example, BS 3 tokens, K 2, experts 0..3, ``expert_ids = [[2, 0], [1, 2], [0, 3]]``:

    copy c = token * K + k:      c  0  1  2  3  4  5
                            expert  2  0  1  2  0  3
    stable sort by expert -> row d: d  0  1  2  3  4  5
                       copy at row  1  4  2  0  3  5
    expand_x[d] = x[copy // K]                rows of tokens 0, 2, 1, 0, 1, 2
    expert_token_nums = [2, 1, 2, 1]          (expert_token_nums_type 1: counts)
    combine: x_out[t] = sum_k expert_scales[t, k] * expand_x[row of copy t * K + k]

``assist_info_for_combine`` is ``(A * 128,)`` int32 with A = BS * K rows here; its device
layout is not documented (the wheel has no doc block for either operator), and only
combine_v2 reads it: the reference keeps, in row d's first three entries, the source rank,
token and top-k slot of the copy at row d.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import OpInputError, describe, require_dtype, require_rank
from .refused import QUANTIZED, UNMODELLED, refuse

#: entries of assist_info_for_combine per expanded row (the operator's (A * 128,) shape)
ASSIST_ROW = 128
#: op-plugin page of aclnnMoeDistributeDispatchV2: groupEp "字符串长度范围为[1, 128)"
MAX_GROUP_NAME = 128
#: the dtypes x / expand_x take ("FLOAT16、BFLOAT16")
TOKEN_DTYPES = (torch.float16, torch.bfloat16)
ONE_RANK = (
    "communication between NPUs over HCCL; the CPU reference runs one rank only "
    "(ep_world_size 1, tp_world_size 0 or 1), where the EP all-to-all is the identity"
)


def npu_moe_distribute_dispatch_v2(
    x: Tensor,
    expert_ids: Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: Tensor | None = None,
    x_active_mask: Tensor | None = None,
    expert_scales: Tensor | None = None,
    elastic_info: Tensor | None = None,
    performance_info: Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
    y_dtype: int | None = None,
    x_dtype: int | None = None,
    scales_dtype: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Sort the top-K copies of ``x`` [BS, H] by expert (one rank: every expert is local).

    Returns:
        ``(expand_x [A, H], dynamic_scales [A] float32 (zeros: no quantization),
        assist_info_for_combine [A * 128] int32, expert_token_nums [E] int64,
        ep_recv_counts [E] int32, tp_recv_counts [1] int32, expand_scales [A] float32)``
        with A = BS * K and E = ``moe_expert_num``; ``expert_token_nums`` holds counts
        (``expert_token_nums_type`` 1) or their running sums (0).
    """
    op = "npu_moe_distribute_dispatch_v2"
    if quant_mode != 0 or scales is not None or {y_dtype, x_dtype, scales_dtype} != {None}:
        refuse(f"{op} (quant_mode/scales/y_dtype/x_dtype/scales_dtype)", QUANTIZED)
    _check_one_rank(op, group_ep, ep_world_size, ep_rank_id, tp_world_size, shared_expert_rank_num)
    _refuse_unmodelled(
        op,
        x_active_mask=x_active_mask is not None,
        elastic_info=elastic_info is not None,
        performance_info=performance_info is not None,
        expert_shard_type=expert_shard_type != 0,
        special_experts=(zero_expert_num, copy_expert_num, const_expert_num) != (0, 0, 0),
    )
    require_dtype(op, "x", x, TOKEN_DTYPES)
    require_rank(op, "x", x, 2, 2)
    _check_expert_ids(op, expert_ids, x.size(0), moe_expert_num)
    if expert_token_nums_type not in (0, 1):
        raise OpInputError(
            f"{op}: expert_token_nums_type must be 0 (cumsum) or 1 (count), "
            f"got {expert_token_nums_type}"
        )
    num_tokens, k = expert_ids.shape
    flat = expert_ids.reshape(-1).long()
    copy_at_row = torch.sort(flat, stable=True).indices  # [A]
    rows = copy_at_row.numel()
    expand_x = x[copy_at_row // k]
    assist = torch.zeros(rows, ASSIST_ROW, dtype=torch.int32, device=x.device)
    assist[:, 1] = (copy_at_row // k).to(torch.int32)  # column 0: the source rank, 0
    assist[:, 2] = (copy_at_row % k).to(torch.int32)
    counts = torch.bincount(flat, minlength=moe_expert_num)
    token_nums = counts if expert_token_nums_type == 1 else counts.cumsum(0)
    expand_scales = torch.zeros(rows, dtype=torch.float32, device=x.device)
    if expert_scales is not None:
        if tuple(expert_scales.shape) != (num_tokens, k):
            raise OpInputError(
                f"{op}: expert_scales must be [{num_tokens}, {k}], got {describe(expert_scales)}"
            )
        expand_scales = expert_scales.float().reshape(-1)[copy_at_row]
    return (
        expand_x,
        torch.zeros(rows, dtype=torch.float32, device=x.device),
        assist.reshape(-1),
        token_nums.to(torch.int64),
        counts.to(torch.int32),
        torch.tensor([rows], dtype=torch.int32, device=x.device),
        expand_scales,
    )


def npu_moe_distribute_combine_v2(
    expand_x: Tensor,
    expert_ids: Tensor,
    assist_info_for_combine: Tensor,
    ep_send_counts: Tensor,
    expert_scales: Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: Tensor | None = None,
    x_active_mask: Tensor | None = None,
    expand_scales: Tensor | None = None,
    shared_expert_x: Tensor | None = None,
    elastic_info: Tensor | None = None,
    ori_x: Tensor | None = None,
    const_expert_alpha_1: Tensor | None = None,
    const_expert_alpha_2: Tensor | None = None,
    const_expert_v: Tensor | None = None,
    performance_info: Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> Tensor:
    """Weigh each expanded row by its token's ``expert_scales`` and sum the K copies back:
    ``x [BS, H]`` in ``expand_x``'s dtype (accumulated in float32), plus ``shared_expert_x``
    when given."""
    op = "npu_moe_distribute_combine_v2"
    if comm_quant_mode != 0:
        refuse(f"{op} (comm_quant_mode)", QUANTIZED)
    _check_one_rank(op, group_ep, ep_world_size, ep_rank_id, tp_world_size, shared_expert_rank_num)
    _refuse_unmodelled(
        op,
        x_active_mask=x_active_mask is not None,
        elastic_info=elastic_info is not None,
        performance_info=performance_info is not None,
        expert_shard_type=expert_shard_type != 0,
        special_experts=(zero_expert_num, copy_expert_num, const_expert_num) != (0, 0, 0)
        or any(t is not None for t in (ori_x, const_expert_alpha_1, const_expert_alpha_2))
        or const_expert_v is not None,
    )
    require_dtype(op, "expand_x", expand_x, TOKEN_DTYPES)
    require_rank(op, "expand_x", expand_x, 2, 2)
    num_tokens = expert_ids.size(0) if expert_ids.dim() == 2 else -1
    _check_expert_ids(op, expert_ids, num_tokens, moe_expert_num)
    require_dtype(op, "expert_scales", expert_scales, (torch.float32,))
    if expert_scales.shape != expert_ids.shape:
        raise OpInputError(
            f"{op}: expert_scales must have expert_ids' shape {tuple(expert_ids.shape)}, "
            f"got {describe(expert_scales)}"
        )
    rows = int(ep_send_counts.sum())
    if rows > expand_x.size(0) or assist_info_for_combine.numel() < rows * ASSIST_ROW:
        raise OpInputError(
            f"{op}: {rows} rows sent, but expand_x has {expand_x.size(0)} and "
            f"assist_info_for_combine {assist_info_for_combine.numel()} entries "
            f"({ASSIST_ROW} per row): pass dispatch_v2's outputs unchanged"
        )
    assist = assist_info_for_combine.reshape(-1)[: rows * ASSIST_ROW].view(rows, ASSIST_ROW).long()
    token, slot = assist[:, 1], assist[:, 2]
    weighted = expand_x[:rows].float() * expert_scales[token, slot].unsqueeze(-1)
    out = torch.zeros(num_tokens, expand_x.size(1), dtype=torch.float32, device=expand_x.device)
    out.index_add_(0, token, weighted)
    if shared_expert_x is not None:
        if tuple(shared_expert_x.shape) != tuple(out.shape):
            raise OpInputError(
                f"{op}: shared_expert_x must be {list(out.shape)}, got {describe(shared_expert_x)}"
            )
        out = out + shared_expert_x.float()
    return out.to(expand_x.dtype)


def _check_one_rank(
    op: str, group_ep: str, ep_world_size: int, ep_rank_id: int, tp_world_size: int, shared: int
) -> None:
    if not isinstance(group_ep, str) or not 1 <= len(group_ep) < MAX_GROUP_NAME:
        raise OpInputError(
            f"{op}: group_ep must be the EP group's communicator name, a str of length "
            f"[1, {MAX_GROUP_NAME}), got {group_ep!r}"
        )
    if ep_world_size != 1 or ep_rank_id != 0 or tp_world_size > 1 or shared != 0:
        refuse(
            f"{op} (ep_world_size={ep_world_size}, ep_rank_id={ep_rank_id}, "
            f"tp_world_size={tp_world_size}, shared_expert_rank_num={shared})",
            ONE_RANK,
        )


def _refuse_unmodelled(op: str, **used: bool) -> None:
    names = [name for name, on in used.items() if on]
    if names:
        refuse(f"{op} ({', '.join(names)})", UNMODELLED)


def _check_expert_ids(op: str, expert_ids: Tensor, num_tokens: int, num_experts: int) -> None:
    require_rank(op, "expert_ids", expert_ids, 2, 2)
    require_dtype(op, "expert_ids", expert_ids, (torch.int32,))
    if expert_ids.size(0) != num_tokens:
        raise OpInputError(f"{op}: expert_ids rows {expert_ids.size(0)} != tokens {num_tokens}")
    if not 0 < expert_ids.size(1) <= num_experts:
        raise OpInputError(
            f"{op}: K = {expert_ids.size(1)} must satisfy 0 < K <= moe_expert_num {num_experts}"
        )
    if bool(((expert_ids < 0) | (expert_ids >= num_experts)).any()):
        raise OpInputError(f"{op}: expert_ids must lie in [0, {num_experts})")
    ordered = expert_ids.sort(dim=1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise OpInputError(
            f"{op}: the K experts of a token must differ (同一行中的K个value不能重复)"
        )
