"""torch_npu.npu_lightning_indexer: the DSA indexer's top-k key positions per query token.

For query token i of a request and key head n (its query heads h form the group G(n)):

    score[i, j] = sum over h in G(n) of  weights[i, h] * relu(query[i, h] . key[j, n])

(kernel doc formula ``Top-k{[1]_{1xg} @ [(W @ [1]_{1xS_k}) (.) ReLU(Q_index @ K_index^T)]}``;
no softmax scale: DSA folds it into ``weights``). Key j is a candidate when j < kv_len
(sparse_mode 0) or j < kv_len - q_len + i + 1 (sparse_mode 3, bottom-right causal). Each row
of ``sparse_indices`` lists the candidates by descending score, ties to the lower position,
the first ``min(sparse_count, candidates)`` of them at the front and -1 after:

    kv_len 5, q_len 2, sparse_count 4, mode 3: row 0 sees keys 0..3, e.g. [2, 0, 3, 1]
                                                row 1 sees keys 0..4, e.g. [4, 2, 0, 3]
    kv_len 2, sparse_count 4: every row is e.g. [1, 0, -1, -1]

NOTE: the tie order (lower position first) is the operator's golden test's stable sort;
unconfirmed on device. Positions are logical (0 .. kv_len - 1), also with PA_BSND keys.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ._checks import OpInputError, describe, strict_keywords
from .graph_ops import capturable
from .sparse_inputs import (
    PAGED,
    LengthArgs,
    SparseLengths,
    causal_limits,
    check_layouts,
    padded_keys,
    padded_query,
    query_layout,
    resolve_lengths,
)
from .sparse_limits import (
    UNBOUNDED_TOKENS,
    check_common,
    check_half,
    check_index_tensor,
    check_indexer_dims,
    check_key_heads,
    check_paged_block_size,
    check_same_dtype,
    check_sparse_count,
)

OP = "npu_lightning_indexer"
NAMES = LengthArgs(
    op=OP,
    q_lens="actual_seq_lengths_query",
    kv_lens="actual_seq_lengths_key",
    layout_kv="layout_key",
)
_HINTS = {
    "actual_seq_lengths_kv": "the indexer's key lengths are `actual_seq_lengths_key`",
    "layout_kv": "the indexer's key layout is `layout_key`",
    "topk": "the number of positions kept is `sparse_count`",
}


def _indexer_fake(args: SimpleNamespace) -> tuple[Tensor, Tensor]:
    """The output shapes of torch_npu 2.13.0's meta registration: indices int32
    [B, S1, N2, sparse_count] (BSND query) or [T, N2, sparse_count], the key heads read from
    dim 1 of a TND key and dim 2 of a (PA_)BSND one; values the same shape in the query dtype
    with ``return_value``, else empty."""
    query, key, count = args.query, args.key, args.sparse_count
    if args.layout_query == "BSND":
        shape = (query.size(0), query.size(1), key.size(2), count)
    else:
        shape = (query.size(0), key.size(1 if args.layout_key == "TND" else 2), count)
    values = query.new_empty(shape if args.return_value else (0,))
    return query.new_empty(shape, dtype=torch.int32), values


@strict_keywords(OP, _HINTS)
@capturable("lightning_indexer", _indexer_fake)
def npu_lightning_indexer(
    query: Tensor,
    key: Tensor,
    weights: Tensor,
    *,
    actual_seq_lengths_query: Tensor | None = None,
    actual_seq_lengths_key: Tensor | None = None,
    block_table: Tensor | None = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED_TOKENS,
    next_tokens: int = UNBOUNDED_TOKENS,
    return_value: bool = False,
) -> tuple[Tensor, Tensor]:
    """Top-``sparse_count`` key positions per query token and key head.

    Returns:
        (sparse_indices, sparse_values): int32 ``[B, S1, N2, sparse_count]`` (BSND query) or
        ``[T1, N2, sparse_count]`` (TND), -1 in unused slots and in padded query rows; the
        scores at those positions in the query dtype with ``return_value=True`` (-inf in
        unused slots, unconfirmed on device), else an empty tensor.
    """
    _check_inputs(query, key, weights, layout_query, layout_key, block_table, return_value)
    check_common(OP, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens)
    check_sparse_count(OP, sparse_count)
    for name, t in (
        ("actual_seq_lengths_query", actual_seq_lengths_query),
        ("actual_seq_lengths_key", actual_seq_lengths_key),
        ("block_table", block_table),
    ):
        check_index_tensor(OP, name, t)
    lengths = resolve_lengths(
        NAMES,
        query=query,
        key=key,
        layout_query=layout_query,
        layout_kv=layout_key,
        q_lens_arg=actual_seq_lengths_query,
        kv_lens_arg=actual_seq_lengths_key,
        block_table=block_table,
    )
    q = padded_query(query, layout_query, lengths.q_lens, "query").float()  # [B, N1, S1, D]
    w = padded_query(weights.unsqueeze(-1), layout_query, lengths.q_lens, "weights").float()
    k = padded_keys(key, layout_key, lengths, block_table, "key").float()  # [B, N2, S2, D]
    scores = _scores(q, k, w[..., 0])  # [B, N2, S1, S2]
    indices, values = _top_k(scores, lengths, sparse_mode, sparse_count)
    indices = query_layout(indices, layout_query, lengths.q_lens)
    if not return_value:
        return indices, query.new_empty((0,))
    return indices, query_layout(values, layout_query, lengths.q_lens).to(query.dtype)


def _check_inputs(
    query: Tensor,
    key: Tensor,
    weights: Tensor,
    layout_query: str,
    layout_key: str,
    block_table: Tensor | None,
    return_value: bool,
) -> None:
    check_layouts(NAMES, layout_query, layout_key, block_table)
    q_rank = 4 if layout_query == "BSND" else 3
    k_rank = 3 if layout_key == "TND" else 4
    if query.dim() != q_rank:
        raise OpInputError(
            f"{OP}: layout_query {layout_query!r} needs a {q_rank}-D query, got {describe(query)}"
        )
    if key.dim() != k_rank:
        raise OpInputError(
            f"{OP}: layout_key {layout_key!r} needs a {k_rank}-D key, got {describe(key)}"
        )
    if weights.shape != query.shape[:-1]:
        raise OpInputError(
            f"{OP}: weights must be {list(query.shape[:-1])} (the query without its head dim), "
            f"got {describe(weights)}"
        )
    if query.numel() == 0 or key.numel() == 0:
        raise OpInputError(f"{OP}: query and key must not be empty")
    check_key_heads(OP, "key", key)
    if query.size(-1) != key.size(-1):
        raise OpInputError(
            f"{OP}: query and key head dims differ: {describe(query)}, {describe(key)}"
        )
    # kernel doc: "参数query、key的数据类型应保持一致"; "参数weights不为float32时，参数query、
    # key、weights的数据类型应保持一致"
    check_same_dtype(OP, query=query, key=key)
    if weights.dtype != torch.float32:
        check_same_dtype(OP, query=query, weights=weights)
    check_half(OP, query=query, key=key)
    check_indexer_dims(OP, query)
    if layout_key == PAGED:
        check_paged_block_size(OP, key.size(1))
        if return_value:
            # kernel doc, return_values: "仅在训练且layout_key不为PA_BSND场景支持"
            raise OpInputError(
                f"{OP}: return_value=True is not supported with layout_key 'PA_BSND'"
            )


def _scores(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """sum_h w[h] * relu(q[h] . k) per key head: [B, N1, S1, D] x [B, N2, S2, D] -> [B, N2, S1, S2]."""
    b, n1, s1, _ = q.shape
    n2 = k.size(1)
    if n1 % n2:
        raise OpInputError(f"{OP}: query heads {n1} are not a multiple of key heads {n2}")
    g = n1 // n2
    qg = q.view(b, n2, g, s1, -1)
    dots = torch.einsum("bngsd,bntd->bngst", qg, k).clamp_min_(0.0)  # [B, N2, G, S1, S2]
    wg = w.view(b, n2, g, s1, 1)
    return (dots * wg).sum(dim=2)


def _top_k(
    scores: Tensor, lengths: SparseLengths, sparse_mode: int, sparse_count: int
) -> tuple[Tensor, Tensor]:
    """Rows of candidates by descending score, -1 / -inf after them: [B, N2, S1, sparse_count]."""
    s1 = scores.size(2)
    device = scores.device
    limit = causal_limits(lengths, sparse_mode, s1, device)  # [B, S1]
    q_lens = torch.tensor(lengths.q_lens, device=device).view(-1, 1)
    limit = torch.where(torch.arange(s1, device=device).view(1, -1) < q_lens, limit, 0)
    return top_k_below(scores, limit, sparse_count)


def top_k_below(scores: Tensor, limit: Tensor, sparse_count: int) -> tuple[Tensor, Tensor]:
    """Per row, the key positions j < limit by descending score (ties: lower j first), -1 and
    -inf after them. scores [B, N2, S1, S2], limit [B, S1] -> two [B, N2, S1, sparse_count]."""
    b, n2, s1, s2 = scores.shape
    device = scores.device
    limit = limit.clamp(min=0)
    pos = torch.arange(s2, device=device)
    allowed = pos.view(1, 1, -1) < limit.unsqueeze(-1)  # [B, S1, S2]
    masked = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    values, order = torch.sort(masked, dim=-1, descending=True, stable=True)
    width = min(sparse_count, s2)
    values, order = values[..., :width], order[..., :width]
    slot = torch.arange(width, device=device).view(1, 1, 1, -1)
    keep = slot < limit.view(b, 1, s1, 1)
    indices = torch.full((b, n2, s1, sparse_count), -1, dtype=torch.int32, device=device)
    indices[..., :width] = torch.where(keep, order.to(torch.int32), -1)
    out_values = torch.full((b, n2, s1, sparse_count), float("-inf"), device=device)
    out_values[..., :width] = torch.where(keep, values, float("-inf"))
    return indices, out_values
