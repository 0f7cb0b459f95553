"""custom.npu_quant_lightning_indexer: the CSA indexer's top-k compressed entries per query
token, from int8 query and keys with fp16 dequant scales, keys paged (``PA_BSND``).

For query row i of a request with S query tokens and N original tokens (``actual_seq_lengths_key``
counts tokens before compression, QLI doc:44), the row sits at position p = N - S + i and

    score[i, j] = sum over heads h of  weights[i, h] * relu(q_scale[i, h] * k_scale[j] * (q[i, h] . k[j]))

(QLI doc:13-17) over the compressed entries j < (p + 1) // cmp_ratio (sparse_mode 3: entry j
folds tokens j*r .. j*r + r - 1) or j < N // cmp_ratio (sparse_mode 0). Each row lists them by
descending score, ties to the lower entry, the first ``min(sparse_count, candidates)`` at the
front and -1 after (as ``../lightning_indexer.py``, the wheel's indexer without ``cmp_ratio``).

NOTE: unconfirmed on device: the tie order; that the causal limit counts finished entries
((p + 1) // r, as transformers' DeepSeek-V4 indexer masks them); the doc's constraint that
weights * q_scale stay within fp16 (QLI doc:77) is the caller's. ``sparse_values`` is not
returned (QLI doc:73, "目前暂不支持返回"): the second output is empty. ``query_dtype`` /
``key_dtype`` are in the registration but not the doc: the reference refuses them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import ReferenceUnsupportedError, describe, strict_keywords
from ..attention_inputs import gather_paged
from ..lightning_indexer import top_k_below
from ..npu_limits import NPU_ONLY
from ..npu_profile import current_profile
from ..sparse_limits import UNBOUNDED_TOKENS
from .limits import (
    MAX_SPARSE_COUNT,
    QLI_CMP_RATIOS,
    QLI_HEAD_DIM,
    QLI_QUERY_HEADS,
    check_int32,
    check_only_default,
    check_paged_cache,
    fail,
)
from .qli_metadata import check_plan

OP = "npu_quant_lightning_indexer"
_FP16 = (torch.float16,)


@strict_keywords(OP, {"topk": "the number kept is `sparse_count`"})
def npu_quant_lightning_indexer(
    query: Tensor,
    key: Tensor,
    weights: Tensor,
    query_dequant_scale: Tensor,
    key_dequant_scale: Tensor,
    query_quant_mode: int,
    key_quant_mode: int,
    *,
    actual_seq_lengths_query: Tensor | None = None,
    actual_seq_lengths_key: Tensor | None = None,
    block_table: Tensor | None = None,
    metadata: Tensor | None = None,
    layout_query: str = "BSND",
    layout_key: str = "PA_BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = 9223372036854775807,
    next_tokens: int = 9223372036854775807,
    cmp_ratio: int = 1,
    return_value: bool = False,
    query_dtype: int | None = None,
    key_dtype: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(sparse_indices, sparse_values)``: int32 [B, S1, 1, sparse_count] or [T1, 1, sparse_count]."""
    _check_arguments(
        query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode,
        key_quant_mode, block_table, layout_query, layout_key, sparse_count, sparse_mode,
        pre_tokens, next_tokens, cmp_ratio, return_value, query_dtype, key_dtype,
    )  # fmt: skip
    if metadata is not None:
        check_plan(
            OP, metadata, num_heads_q=query.size(-2), num_heads_k=1, head_dim=query.size(-1),
            sparse_count=sparse_count, sparse_mode=sparse_mode, cmp_ratio=cmp_ratio,
        )  # fmt: skip
    q_lens = _query_lengths(query, layout_query, actual_seq_lengths_query)
    tokens = _key_tokens(actual_seq_lengths_key, len(q_lens))
    entries = [n // cmp_ratio for n in tokens]
    _check_table(block_table, entries, key.size(1), len(q_lens))
    keys = gather_paged(
        key.reshape(key.size(0), key.size(1), -1),
        block_table,
        entries,
        1,
        "key",
        workspace="qli_key",
    )[:, 0].float()  # fmt: skip  [B, E, D]
    k_scale = gather_paged(
        key_dequant_scale.reshape(key.size(0), key.size(1), 1),
        block_table,
        entries,
        1,
        "key_dequant_scale",
        workspace="qli_key_scale",
    )[:, 0, :, 0].float()  # fmt: skip  [B, E]
    width = max(entries, default=0)
    rows = _split(query, layout_query, q_lens)
    w_rows = _split(weights, layout_query, q_lens)
    s_rows = _split(query_dequant_scale, layout_query, q_lens)
    out_rows = []
    for b, s in enumerate(q_lens):
        scores = _scores(
            rows[b][:s].float(),
            w_rows[b][:s].float(),
            s_rows[b][:s].float(),
            keys[b, :width],
            k_scale[b, :width],
        )  # fmt: skip  [S, E]
        pos = torch.arange(tokens[b] - s, tokens[b], device=query.device)
        limit = (pos + 1) // cmp_ratio if sparse_mode == 3 else torch.full_like(pos, entries[b])
        idx, _ = top_k_below(scores[None, None], limit[None], sparse_count)
        out_rows.append(idx[0, 0])  # [S, sparse_count]
    return _layout(out_rows, query, layout_query, sparse_count), query.new_empty((0,), dtype=torch.float32)  # fmt: skip


def _scores(q: Tensor, w: Tensor, q_scale: Tensor, keys: Tensor, k_scale: Tensor) -> Tensor:
    """sum_h w[h] * relu(q_scale[h] * k_scale * (q[h] . k)): [S, N1, D] x [E, D] -> [S, E]."""
    dots = torch.einsum("shd,ed->she", q, keys) * q_scale.unsqueeze(-1) * k_scale.view(1, 1, -1)
    return (dots.clamp_min(0.0) * w.unsqueeze(-1)).sum(dim=1)


def _check_arguments(
    query, key, weights, q_scale, k_scale, query_quant_mode, key_quant_mode, block_table,
    layout_query, layout_key, sparse_count, sparse_mode, pre_tokens, next_tokens, cmp_ratio,
    return_value, query_dtype, key_dtype,
) -> None:  # fmt: skip
    check_only_default(
        OP,
        query_quant_mode=(query_quant_mode, 0),  # QLI doc:50/52 "当前仅支持传入0"
        key_quant_mode=(key_quant_mode, 0),
        layout_key=(layout_key, "PA_BSND"),  # QLI doc:56
        pre_tokens=(pre_tokens, UNBOUNDED_TOKENS),  # QLI doc:62/64 "仅支持默认值2^63-1"
        next_tokens=(next_tokens, UNBOUNDED_TOKENS),
        return_value=(return_value, False),  # QLI doc:68
    )
    if query_dtype is not None or key_dtype is not None:
        raise ReferenceUnsupportedError(
            f"{OP}: query_dtype / key_dtype (not in the operator's doc) are not modelled"
        )
    if layout_query not in ("BSND", "TND"):
        fail(OP, f"layout_query must be 'BSND' or 'TND', got {layout_query!r}")
    if not 1 <= sparse_count <= MAX_SPARSE_COUNT:
        fail(OP, f"sparse_count must be in [1, {MAX_SPARSE_COUNT}], got {sparse_count}")
    if sparse_mode not in (0, 3):
        fail(OP, f"sparse_mode must be 0 or 3 (rightDownCausal), got {sparse_mode}")
    if cmp_ratio not in QLI_CMP_RATIOS:
        fail(OP, f"cmp_ratio must be one of {list(QLI_CMP_RATIOS)}, got {cmp_ratio}")
    # QLI doc:30/32: "数据类型支持int8" (a quantized operator: no float query or key)
    for name, t in (("query", query), ("key", key)):
        if t.dtype != torch.int8:
            fail(OP, f"`{name}` must be int8 (quantized per token and head), got {describe(t)}")
    q_rank = 4 if layout_query == "BSND" else 3
    if query.dim() != q_rank:
        fail(OP, f"layout_query {layout_query!r} needs a {q_rank}-D query, got {describe(query)}")
    check_paged_cache(OP, "key", key)
    if key.size(-1) != query.size(-1):
        fail(OP, f"query and key head dims differ: {describe(query)}, {describe(key)}")
    for name, t in (("weights", weights), ("query_dequant_scale", q_scale)):
        if tuple(t.shape) != tuple(query.shape[:-1]):
            fail(OP, f"`{name}` must be {list(query.shape[:-1])}, got {describe(t)}")
    if tuple(k_scale.shape) != tuple(key.shape[:-1]):
        fail(OP, f"key_dequant_scale must be {list(key.shape[:-1])}, got {describe(k_scale)}")
    profile = current_profile()
    for name, t in (("weights", weights), ("query_dequant_scale", q_scale), ("key_dequant_scale", k_scale)):  # fmt: skip
        if t.dtype not in (torch.float16, torch.float32) or (profile.dtypes and t.dtype not in _FP16):  # fmt: skip
            # QLI doc:34-38 "数据类型支持float16" (fp32 is a CPU-only convenience)
            fail(OP, f"`{name}` must be float16 on the NPU, got {describe(t)} ({NPU_ONLY})")
    if profile.dims and (query.size(-2) != QLI_QUERY_HEADS or query.size(-1) != QLI_HEAD_DIM):
        fail(OP, f"query must have {QLI_QUERY_HEADS} heads of dim {QLI_HEAD_DIM}, got {describe(query)} ({NPU_ONLY})")  # fmt: skip
    if block_table is None:
        fail(OP, "layout_key 'PA_BSND' requires block_table")
    check_int32(OP, "block_table", block_table, 2)


def _query_lengths(query: Tensor, layout_query: str, lengths: Tensor | None) -> list[int]:
    check_int32(OP, "actual_seq_lengths_query", lengths, 1)
    if layout_query == "TND":
        if lengths is None:
            fail(OP, "layout_query 'TND' requires actual_seq_lengths_query (prefix sums)")
        ends = [int(n) for n in lengths.tolist()]
        out = [b - a for a, b in zip([0, *ends], ends, strict=False)]
        if any(n < 0 for n in out) or (ends and ends[-1] > query.size(0)):
            fail(OP, f"actual_seq_lengths_query must be prefix sums up to {query.size(0)}, got {ends}")  # fmt: skip
        return out
    if lengths is None:
        return [query.size(1)] * query.size(0)
    out = [int(n) for n in lengths.tolist()]
    if len(out) != query.size(0) or any(not 0 <= n <= query.size(1) for n in out):
        fail(OP, f"actual_seq_lengths_query must hold {query.size(0)} values in [0, {query.size(1)}], got {out}")  # fmt: skip
    return out


def _key_tokens(lengths: Tensor | None, batch: int) -> list[int]:
    if lengths is None:
        # QLI doc:44 "当layout_key为TND或PA_BSND时，该入参必须传入"
        fail(OP, "layout_key 'PA_BSND' requires actual_seq_lengths_key")
    check_int32(OP, "actual_seq_lengths_key", lengths, 1)
    tokens = [int(n) for n in lengths.tolist()]
    if len(tokens) != batch or min(tokens, default=0) < 0:
        fail(OP, f"actual_seq_lengths_key must hold {batch} token counts >= 0, got {tokens}")
    return tokens


def _check_table(table: Tensor, entries: list[int], block_size: int, batch: int) -> None:
    # QLI doc:46: "第一维长度需要等于B，第二维长度不能小于maxBlockNumPerSeq"
    if table.size(0) != batch:
        fail(OP, f"block_table has {table.size(0)} rows for {batch} requests")
    need = max((-(-n // block_size) for n in entries), default=0)
    if table.size(1) < need:
        fail(OP, f"block_table has {table.size(1)} columns, the longest request needs {need}")


def _split(x: Tensor, layout_query: str, q_lens: list[int]) -> list[Tensor]:
    return list(x.unbind(0)) if layout_query == "BSND" else list(x.split(q_lens[: len(q_lens)]))


def _layout(rows: list[Tensor], query: Tensor, layout_query: str, k: int) -> Tensor:
    """Rows [S_b, k] per request -> [B, S1, 1, k] (padded rows -1) or [T1, 1, k]."""
    if layout_query == "TND":
        out = torch.full((query.size(0), 1, k), -1, dtype=torch.int32, device=query.device)
        packed = torch.cat(rows) if rows else out[:0, 0]
        out[: packed.size(0), 0] = packed
        return out
    out = torch.full((query.size(0), query.size(1), 1, k), -1, dtype=torch.int32, device=query.device)  # fmt: skip
    for b, r in enumerate(rows):
        out[b, : r.size(0), 0] = r
    return out
