"""custom.npu_sparse_attn_sharedkv: DeepSeek-V4's attention over a sliding window of its own
keys plus compressed keys, K = V, with learnable sinks, both caches paged (``PA_ND``).

For query row i of a request with S query tokens and L = ``seqused_kv`` tokens so far, the row
sits at position p = L - S + i (the last query is the last token) and sees

    window:      ori positions j with p - ori_win_left <= j <= p + ori_win_right   (band, mode 4)
    compressed:  cmp entries e < (p + 1) // cmp_ratio    (rightDownCausal, mode 3; entry e folds
                 positions e*r .. e*r + r - 1, so it is complete once p reaches its last one)
                 and, with ``cmp_sparse_indices``, only the entries listed in the row (-1 = unused)
    s            = softmax_scale * (q[i, h] . k) over all of them, plus sinks[h] as one more logit
    out[i, h]    = sum softmax(s)_k * k      (the sink's share is dropped: it weighs no value)

(SAS doc:9-17, 84: scenario 1 window only, 2 window + all compressed entries (HCA, ratio 128),
3 window + selected compressed entries (CSA, ratio 4)). Positions are logical; the block tables
map them to the paged caches, the compressed cache holding L // cmp_ratio entries.

NOTE: three readings the doc leaves open, unconfirmed on device: (1) the sink enters the
softmax denominator as an extra logit per head (gpt-oss style; SAS doc:53 only names it
"注意力下沉"), as transformers' DeepSeek-V4 attention does; (2) a listed compressed entry past
the row's causal limit is masked (the doc's example only lists valid ones), an entry listed
twice counts twice; (3) ``softmax_scale`` 0 (the schema default for the doc's "None") means
1/sqrt(D). ``softmax_lse`` is not returned (SAS doc:73/78: "目前softmax_lse输出为无效值"): the
second output is an empty float32 tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import ReferenceUnsupportedError, describe, strict_keywords
from ..attention_inputs import gather_paged
from .limits import (
    CMP_MASK_MODE,
    ORI_MASK_MODE,
    ORI_WIN_LEFT,
    ORI_WIN_RIGHT,
    SAS_LAYOUT_KV,
    SAS_LAYOUTS_Q,
    check_cmp_ratio,
    check_dims,
    check_half,
    check_int32,
    check_only_default,
    check_paged_cache,
    check_topk,
    check_unset,
    cu_seqlens_lengths,
    fail,
)
from .sas_metadata import check_plan

OP = "npu_sparse_attn_sharedkv"
_HINTS = {
    "scale": "the scale is `softmax_scale`",
    "block_table": "the caches take `ori_block_table` and `cmp_block_table`",
    "sparse_indices": "the compressed selection is `cmp_sparse_indices`",
}


@strict_keywords(OP, _HINTS)
def npu_sparse_attn_sharedkv(
    q: Tensor,
    *,
    ori_kv: Tensor | None = None,
    cmp_kv: Tensor | None = None,
    ori_sparse_indices: Tensor | None = None,
    cmp_sparse_indices: Tensor | None = None,
    ori_block_table: Tensor | None = None,
    cmp_block_table: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_ori_kv: Tensor | None = None,
    cu_seqlens_cmp_kv: Tensor | None = None,
    seqused_q: Tensor | None = None,
    seqused_kv: Tensor | None = None,
    sinks: Tensor | None = None,
    metadata: Tensor | None = None,
    softmax_scale: float = 0,
    cmp_ratio: int = 0,
    ori_mask_mode: int = 4,
    cmp_mask_mode: int = 3,
    ori_win_left: int = 127,
    ori_win_right: int = 0,
    layout_q: str = "BSND",
    layout_kv: str = "PA_ND",
    return_softmax_lse: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(attention_out, softmax_lse)``: out shaped like q ([B, S1, N1, D] or [T1, N1, D])."""
    _check_arguments(
        q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, ori_block_table,
        cmp_block_table, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, sinks, cmp_ratio,
        ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv,
        return_softmax_lse,
    )  # fmt: skip
    heads, dim = q.size(-2), q.size(-1)
    sparse = cmp_sparse_indices is not None
    check_plan(
        OP, metadata, num_heads_q=heads, num_heads_kv=1, head_dim=dim,
        has_cmp_kv=int(cmp_kv is not None),
        **({"cmp_ratio": cmp_ratio} if cmp_kv is not None else {}),
        **({"cmp_topk": cmp_sparse_indices.size(-1)} if sparse else {}),
    )  # fmt: skip
    q_lens = _query_lengths(q, layout_q, cu_seqlens_q)
    kv_lens = _kv_lengths(q_lens, seqused_kv, ori_kv, ori_block_table)
    scale = softmax_scale if softmax_scale else 1.0 / math.sqrt(dim)
    ori = gather_paged(
        ori_kv.reshape(ori_kv.size(0), ori_kv.size(1), -1), ori_block_table, kv_lens, 1,
        "ori_kv", workspace="sas_ori_kv",
    )[:, 0].float()  # fmt: skip
    cmp = None
    if cmp_kv is not None:
        cmp_lens = [n // cmp_ratio for n in kv_lens]
        _check_table(cmp_block_table, "cmp_block_table", cmp_lens, cmp_kv.size(1), len(q_lens))
        cmp = gather_paged(
            cmp_kv.reshape(cmp_kv.size(0), cmp_kv.size(1), -1), cmp_block_table, cmp_lens, 1,
            "cmp_kv", workspace="sas_cmp_kv",
        )[:, 0].float()  # fmt: skip
    rows = _rows(q, layout_q, q_lens)
    selected = _rows(cmp_sparse_indices, layout_q, q_lens) if sparse else None
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    out_rows = _rows(out, layout_q, q_lens)
    sink = sinks.float() if sinks is not None else None
    for b, (s, n) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if s == 0:
            continue
        pos = torch.arange(n - s, n, device=q.device)  # [S]
        qb = rows[b].float()  # [S, N1, D]
        logits, values = [_window(qb, ori[b, :n], pos, scale)], [ori[b, :n]]
        if cmp is not None:
            limit = (pos + 1) // cmp_ratio
            entries = cmp[b, : n // cmp_ratio]
            if sparse:
                chosen, keys = _selected(selected[b][:, 0], entries, limit)
                logits.append(torch.einsum("shd,skd->shk", qb, keys) * scale + chosen)
                values.append(keys)
            else:
                logits.append(_causal(qb, entries, limit, scale))
                values.append(entries)
        out_rows[b].copy_(_combine(logits, values, sink))
    return out, q.new_empty((0,), dtype=torch.float32)


def _check_arguments(
    q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, ori_block_table,
    cmp_block_table, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, sinks, cmp_ratio,
    ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv,
    return_softmax_lse,
) -> None:  # fmt: skip
    check_only_default(
        OP,
        ori_mask_mode=(ori_mask_mode, ORI_MASK_MODE),
        cmp_mask_mode=(cmp_mask_mode, CMP_MASK_MODE),
        ori_win_left=(ori_win_left, ORI_WIN_LEFT),
        ori_win_right=(ori_win_right, ORI_WIN_RIGHT),
        layout_kv=(layout_kv, SAS_LAYOUT_KV),
    )
    if layout_q not in SAS_LAYOUTS_Q:
        fail(OP, f"layout_q must be one of {list(SAS_LAYOUTS_Q)}, got {layout_q!r}")
    # SAS doc:35 "目前暂不支持对ori_kv进行稀疏计算，故设置此参数无效"; :45/47 "layout_kv仅支持
    # PA_ND，故设置此参数无效"; :49 seqused_q "目前暂不支持指定该参数"; :73 softmax_lse
    check_unset(OP, "the device ignores it", ori_sparse_indices=ori_sparse_indices)
    check_unset(
        OP, "layout_kv 'PA_ND' ignores it",
        cu_seqlens_ori_kv=cu_seqlens_ori_kv, cu_seqlens_cmp_kv=cu_seqlens_cmp_kv,
    )  # fmt: skip
    check_unset(
        OP, "not supported by the operator yet",
        seqused_q=seqused_q, return_softmax_lse=return_softmax_lse,
    )  # fmt: skip
    q_rank = 4 if layout_q == "BSND" else 3
    if q.dim() != q_rank:
        fail(OP, f"layout_q {layout_q!r} needs a {q_rank}-D q, got {describe(q)}")
    if ori_kv is None or ori_block_table is None:
        # SAS doc:84: every scenario passes the window cache ori_kv (paged: with its table)
        fail(OP, "ori_kv and ori_block_table are required (every scenario attends the window)")
    check_paged_cache(OP, "ori_kv", ori_kv)
    if cmp_kv is not None:
        check_paged_cache(OP, "cmp_kv", cmp_kv)
        check_cmp_ratio(OP, cmp_ratio)
        if cmp_block_table is None:
            fail(OP, "cmp_kv needs cmp_block_table (layout_kv 'PA_ND')")
    elif cmp_sparse_indices is not None:
        fail(OP, "cmp_sparse_indices selects compressed entries: pass cmp_kv too")
    # SAS doc:87 "目前所有输入不支持传入空tensor"
    for name, t in (("q", q), ("ori_kv", ori_kv), ("cmp_kv", cmp_kv)):
        if t is not None and t.numel() == 0:
            fail(OP, f"`{name}` must not be empty")
    for name, t in (("ori_kv", ori_kv), ("cmp_kv", cmp_kv)):
        if t is not None and t.size(-1) != q.size(-1):
            fail(OP, f"q and {name} head dims differ: {describe(q)}, {describe(t)}")
    # SAS doc:86 "参数q、ori_kv、cmp_kv的数据类型必须保持一致"
    dtypes = {t.dtype for t in (q, ori_kv, cmp_kv) if t is not None}
    if len(dtypes) > 1:
        fail(OP, f"q, ori_kv and cmp_kv must share one dtype, got {sorted(map(str, dtypes))}")
    check_half(OP, q=q)
    check_dims(OP, heads=q.size(-2), head_dim=q.size(-1))
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (q.size(-2),)):
        # SAS doc:53 "数据类型支持float32，shape为[N1]"
        fail(OP, f"sinks must be float32 of shape [{q.size(-2)}], got {describe(sinks)}")
    check_int32(OP, "ori_block_table", ori_block_table, 2)
    check_int32(OP, "cmp_block_table", cmp_block_table, 2)
    if cmp_sparse_indices is not None:
        # SAS doc:37 "[Q_T, KV_N, K2]" (TND); BSND adds the batch and sequence axes
        check_int32(OP, "cmp_sparse_indices", cmp_sparse_indices, q_rank)
        if tuple(cmp_sparse_indices.shape[:-1]) != (*q.shape[:-2], 1):
            fail(
                OP,
                f"cmp_sparse_indices must be [{', '.join(map(str, q.shape[:-2]))}, 1, K2] "
                f"(one row per query token), got {describe(cmp_sparse_indices)}",
            )
        check_topk(OP, cmp_sparse_indices.size(-1))


def _query_lengths(q: Tensor, layout_q: str, cu_seqlens_q: Tensor | None) -> list[int]:
    if layout_q == "BSND":
        check_unset(OP, "layout_q 'BSND' holds S1 tokens per request", cu_seqlens_q=cu_seqlens_q)
        return [q.size(1)] * q.size(0)
    if cu_seqlens_q is None:
        fail(OP, "layout_q 'TND' requires cu_seqlens_q")
    check_int32(OP, "cu_seqlens_q", cu_seqlens_q, 1)
    lengths = cu_seqlens_lengths(OP, "cu_seqlens_q", cu_seqlens_q)
    if sum(lengths) != q.size(0):
        fail(OP, f"cu_seqlens_q ends at {sum(lengths)} but q holds {q.size(0)} tokens")
    return lengths


def _kv_lengths(
    q_lens: list[int], seqused_kv: Tensor | None, ori_kv: Tensor, table: Tensor
) -> list[int]:
    if seqused_kv is None:
        # SAS doc:51 "不输入则所有token均参与运算": a paged cache has no such length
        raise ReferenceUnsupportedError(
            f"{OP}: the reference needs seqused_kv (tokens per request) with paged caches"
        )
    check_int32(OP, "seqused_kv", seqused_kv, 1)
    lengths = [int(n) for n in seqused_kv.tolist()]
    if len(lengths) != len(q_lens):
        fail(OP, f"seqused_kv holds {len(lengths)} lengths for {len(q_lens)} requests")
    for b, (s, n) in enumerate(zip(q_lens, lengths, strict=True)):
        if n < s:
            fail(OP, f"seqused_kv[{b}]={n} is shorter than the request's {s} query tokens")
    _check_table(table, "ori_block_table", lengths, ori_kv.size(1), len(q_lens))
    return lengths


def _check_table(table: Tensor, name: str, lengths: list[int], block_size: int, batch: int):
    # SAS doc:39/41: "第一维长度为B，第二维长度不小于 ... S_max / block_size向上取整"
    if table.size(0) != batch:
        fail(OP, f"{name} has {table.size(0)} rows for {batch} requests")
    need = max((-(-n // block_size) for n in lengths), default=0)
    if table.size(1) < need:
        fail(OP, f"{name} has {table.size(1)} columns, the longest request needs {need}")


def _rows(x: Tensor, layout_q: str, q_lens: list[int]) -> list[Tensor]:
    """Per-request views [S, ...] of a BSND / TND query-side tensor."""
    if layout_q == "BSND":
        return list(x.unbind(0))
    return list(x.split(q_lens, dim=0))


def _window(q: Tensor, keys: Tensor, pos: Tensor, scale: float) -> Tensor:
    """Band-masked logits over the request's window keys: [S, N1, L]."""
    j = torch.arange(keys.size(0), device=q.device).view(1, -1)
    p = pos.view(-1, 1)
    inside = (j >= p - ORI_WIN_LEFT) & (j <= p + ORI_WIN_RIGHT)
    logits = torch.einsum("shd,ld->shl", q, keys) * scale
    return logits.masked_fill(~inside.unsqueeze(1), float("-inf"))


def _causal(q: Tensor, entries: Tensor, limit: Tensor, scale: float) -> Tensor:
    """Logits over every complete compressed entry: [S, N1, E]."""
    e = torch.arange(entries.size(0), device=q.device).view(1, -1)
    logits = torch.einsum("shd,ed->she", q, entries) * scale
    return logits.masked_fill(~(e < limit.view(-1, 1)).unsqueeze(1), float("-inf"))


def _selected(indices: Tensor, entries: Tensor, limit: Tensor) -> tuple[Tensor, Tensor]:
    """The listed entries per row: (0 / -inf bias [S, 1, K2], keys [S, K2, D])."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < limit.view(-1, 1)) & (idx < entries.size(0))
    keys = entries[idx.clamp(0, max(entries.size(0) - 1, 0))] if entries.numel() else None
    if keys is None:
        keys = entries.new_zeros((*idx.shape, entries.size(-1)))
    bias = torch.zeros(idx.shape, device=idx.device).masked_fill(~valid, float("-inf"))
    return bias.unsqueeze(1), keys


def _combine(logits: list[Tensor], values: list[Tensor], sink: Tensor | None) -> Tensor:
    """One softmax over every part (and the sink logit), then the weighted values: [S, N1, D]."""
    parts = list(logits)
    if sink is not None:
        parts.append(sink.view(1, -1, 1).expand(logits[0].size(0), -1, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)
    out, start = 0, 0
    for part, v in zip(logits, values, strict=True):
        width = part.size(-1)
        w = probs[..., start : start + width]
        if v.dim() == 2:
            out = out + torch.einsum("shk,kd->shd", w, v)
        else:  # per-row selected keys [S, K2, D]
            out = out + torch.einsum("shk,skd->shd", w, v)
        start += width
    return out
