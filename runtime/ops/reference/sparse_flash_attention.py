"""torch_npu.npu_sparse_flash_attention: absorbed-MLA attention over the selected positions only.

For query row i of a request (kv_len keys, q_len queries), key head n and its query heads:

    limit  = kv_len (sparse_mode 0)  or  kv_len - q_len + i + 1 (sparse_mode 3)
    chosen = for the first ceil(limit / sparse_block_size) entries e of sparse_indices[i, n]
             before the first -1: positions e*sbs .. e*sbs + sbs - 1 that are < limit
    s_j    = scale_value * (query[i] . key[j] + query_rope[i] . key_rope[j])   j in chosen
    out[i] = softmax(s) @ value[chosen]

With ``sparse_block_size`` (sbs) 1 an entry is one token; with sbs > 1 it names a block of
sbs tokens that share one decision. A row that chooses nothing, and in mode 3 a row with
q_len - kv_len > i, is zero. ``softmax_max``/``softmax_sum`` are the row's max of s and sum
of exp(s - max) (zero for empty rows). This is the operator's golden test's reading of the
kernel doc (hicann/ops-transformer ``sparse_flash_attention_golden.py``); what the device
writes in empty rows is unconfirmed. A position chosen twice counts twice, as there.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ._checks import OpInputError, ReferenceUnsupportedError, describe, strict_keywords
from .attention_inputs import padded_to_packed
from .graph_ops import capturable
from .npu_limits import NPU_ONLY
from .npu_profile import current_profile
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
    MLA_ABSORB_MODE,
    UNBOUNDED_TOKENS,
    check_attention_dims,
    check_common,
    check_half,
    check_index_tensor,
    check_key_heads,
    check_paged_block_size,
    check_same_dtype,
    check_sparse_block_size,
)

OP = "npu_sparse_flash_attention"
NAMES = LengthArgs(
    op=OP, q_lens="actual_seq_lengths_query", kv_lens="actual_seq_lengths_kv", layout_kv="layout_kv"
)
_HINTS = {
    "atten_mask": "the selection is `sparse_indices` and causality `sparse_mode`; the operator "
    "takes no dense mask",
    "scale": "the scale keyword is `scale_value`",
    "softmax_scale": "the scale keyword is `scale_value`",
    "actual_seq_lengths_key": "the key lengths are `actual_seq_lengths_kv`",
    "layout_key": "the key layout is `layout_kv`",
    "block_size": "the paged block size is read from the cache; `sparse_block_size` is the "
    "selection granularity",
}


def _sparse_attention_fake(args: SimpleNamespace) -> tuple[Tensor, Tensor, Tensor]:
    """The output shapes of torch_npu 2.13.0's meta registration: the output in the query's
    shape and dtype; softmax max / sum fp32 [B, KV_N, S1, G] (BSND) or [KV_N, T, G] (TND) with
    ``return_softmax_lse``, else empty.

    NOTE: for a TND query the meta function reads KV_N as ``key.size(1)``, which is the block
    size of a PA_BSND key; the key's head dim (-2) is KV_N in every key layout, and is what the
    reference returns (the shapes profile refuses the lse with PA_BSND, as A2/A3 do)."""
    query = args.query
    out = torch.empty_like(query)
    if not args.return_softmax_lse:
        return (
            out,
            query.new_empty((0,), dtype=torch.float32),
            query.new_empty((0,), dtype=torch.float32),
        )
    kv_heads = args.key.size(-2)
    if args.layout_query == "BSND":
        shape = (query.size(0), kv_heads, query.size(1), query.size(2) // kv_heads)
    else:
        shape = (kv_heads, query.size(0), query.size(1) // kv_heads)
    lse = query.new_empty(shape, dtype=torch.float32)
    return out, lse, torch.empty_like(lse)


# NOTE: the doc pages print `sparse_block_size` as a required positional argument; the schema
# the binding is generated from makes it keyword-only with default 1, and the schema wins.
@strict_keywords(OP, _HINTS)
@capturable("sparse_flash_attention", _sparse_attention_fake)
def npu_sparse_flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor | None,
    sparse_indices: Tensor,
    scale_value: float,
    *,
    block_table: Tensor | None = None,
    actual_seq_lengths_query: Tensor | None = None,
    actual_seq_lengths_kv: Tensor | None = None,
    query_rope: Tensor | None = None,
    key_rope: Tensor | None = None,
    sparse_block_size: int = 1,
    layout_query: str = "BSND",
    layout_kv: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = UNBOUNDED_TOKENS,
    next_tokens: int = UNBOUNDED_TOKENS,
    attention_mode: int = 0,
    return_softmax_lse: bool = False,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse attention over the positions ``sparse_indices`` selects (module docstring).

    Returns:
        (attention_out, softmax_max, softmax_sum): the output in the query's layout, shape and
        dtype; with ``return_softmax_lse`` fp32 ``[B, KV_N, S1, Q_N / KV_N]`` (BSND) or
        ``[KV_N, T, Q_N / KV_N]`` (TND), else empty fp32 tensors.
    """
    _check_inputs(
        query, key, value, sparse_indices, query_rope, key_rope, layout_query, layout_kv,
        block_table, sinks,
    )  # fmt: skip
    check_common(OP, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens)
    if attention_mode != MLA_ABSORB_MODE:
        # kernel doc, attention_mode: "仅支持传入2，表示MLA-absorb模式"
        raise OpInputError(
            f"{OP}: attention_mode must be {MLA_ABSORB_MODE} (MLA absorb, the only mode the "
            f"docs list), got {attention_mode}"
        )
    paged = layout_kv == PAGED
    check_sparse_block_size(OP, sparse_block_size, key.size(1) if paged else None)
    if paged and return_softmax_lse and current_profile().shapes:
        # kernel doc, A2/A3: "return_softmax_lse为True时，layout_kv不支持PA_BSND"
        raise OpInputError(
            f"{OP}: return_softmax_lse=True is not supported with layout_kv 'PA_BSND' ({NPU_ONLY})"
        )
    lengths = resolve_lengths(
        NAMES,
        query=query,
        key=key,
        layout_query=layout_query,
        layout_kv=layout_kv,
        q_lens_arg=actual_seq_lengths_query,
        kv_lens_arg=actual_seq_lengths_kv,
        block_table=block_table,
    )
    chosen = _chosen_positions(
        sparse_indices, layout_query, lengths, sparse_mode, sparse_block_size
    )
    out, row_max, row_sum = _attend(
        query, key, value, query_rope, key_rope, layout_query, layout_kv, lengths, block_table,
        chosen, scale_value,
    )  # fmt: skip
    out = query_layout(out, layout_query, lengths.q_lens).to(query.dtype)
    if not return_softmax_lse:
        empty = query.new_empty((0,), dtype=torch.float32)
        return out, empty, empty.clone()
    return (
        out,
        _lse_layout(row_max, layout_query, lengths),
        _lse_layout(row_sum, layout_query, lengths),
    )


def _check_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor | None,
    sparse_indices: Tensor,
    query_rope: Tensor | None,
    key_rope: Tensor | None,
    layout_query: str,
    layout_kv: str,
    block_table: Tensor | None,
    sinks: Tensor | None,
) -> None:
    check_layouts(NAMES, layout_query, layout_kv, block_table)
    if value is None:
        # meta registration: "value=None is only supported with CANN >= 9.2.0"; the docs do not
        # say what it computes then
        raise ReferenceUnsupportedError(
            f"{OP}: value=None (CANN >= 9.2.0) is not modelled by the reference; pass the latent "
            "cache as value"
        )
    if sinks is not None:
        # kernel doc: "sinks仅支持Ascend 950PR&950DT系列产品"
        raise ReferenceUnsupportedError(
            f"{OP}: `sinks` is supported on Ascend 950 only and not modelled by the reference"
        )
    if query_rope is None or key_rope is None:
        # kernel doc: "当前只支持query_rope和key_rope传入，不支持rope为空"
        raise OpInputError(f"{OP}: query_rope and key_rope are required (MLA absorb)")
    q_rank = 4 if layout_query == "BSND" else 3
    k_rank = 3 if layout_kv == "TND" else 4
    for name, t, rank in (("query", query, q_rank), ("query_rope", query_rope, q_rank),
                          ("key", key, k_rank), ("value", value, k_rank), ("key_rope", key_rope, k_rank),
                          ("sparse_indices", sparse_indices, q_rank)):  # fmt: skip
        if t.dim() != rank:
            raise OpInputError(f"{OP}: `{name}` must be {rank}-D for its layout, got {describe(t)}")
        if t.numel() == 0:
            raise OpInputError(f"{OP}: `{name}` must not be empty")
    if value.shape != key.shape:
        # kernel doc, value: "shape与key的shape一致"
        raise OpInputError(
            f"{OP}: value must have the key's shape {list(key.shape)}, got {describe(value)}"
        )
    if query_rope.shape[:-1] != query.shape[:-1] or key_rope.shape[:-1] != key.shape[:-1]:
        raise OpInputError(
            f"{OP}: query_rope / key_rope must match query / key except the last dim, got "
            f"{describe(query_rope)} for {describe(query)} and {describe(key_rope)} for {describe(key)}"
        )
    if query.size(-1) != key.size(-1):
        raise OpInputError(
            f"{OP}: query and key head dims differ: {describe(query)}, {describe(key)}"
        )
    if query_rope.size(-1) != key_rope.size(-1):
        raise OpInputError(f"{OP}: query_rope and key_rope dims differ")
    check_key_heads(OP, "key", key)
    if sparse_indices.shape[:-1] != (*query.shape[:-2], key.size(-2)):
        raise OpInputError(
            f"{OP}: sparse_indices must be [*query rows, KV_N, sparse_size] = "
            f"{[*query.shape[:-2], key.size(-2), 'sparse_size']}, got {describe(sparse_indices)}"
        )
    check_index_tensor(OP, "sparse_indices", sparse_indices)
    check_index_tensor(OP, "block_table", block_table)
    # kernel doc: "参数query、key、value的数据类型必须保持一致"
    check_same_dtype(
        OP, query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope
    )
    check_half(OP, query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope)
    check_attention_dims(OP, query, query_rope)
    if layout_kv == PAGED:
        check_paged_block_size(OP, key.size(1))


def _chosen_positions(
    sparse_indices: Tensor, layout_query: str, lengths: SparseLengths, sparse_mode: int, sbs: int
) -> tuple[Tensor, Tensor]:
    """Logical key positions each row attends and which of them count: both [B, N2, S1, K*sbs]."""
    idx = padded_query(sparse_indices, layout_query, lengths.q_lens, "sparse_indices").long()
    b, n2, s1, k = idx.shape  # [B, N2, S1, K]
    device = idx.device
    _check_valid_front(idx, lengths)
    limit = causal_limits(lengths, sparse_mode, s1, device).view(b, 1, s1, 1)
    # only the first ceil(limit / sbs) entries are read, and none after the first -1
    entry = torch.arange(k, device=device).view(1, 1, 1, -1)
    # (-1 entries sit only at the end of a row: _check_valid_front)
    read = (entry < (limit + sbs - 1).div(sbs, rounding_mode="floor")) & (idx >= 0)
    offsets = torch.arange(sbs, device=device)
    pos = (idx.unsqueeze(-1) * sbs + offsets).view(b, n2, s1, k * sbs)
    kv = torch.tensor(lengths.kv_lens, device=device).view(b, 1, 1, 1)
    ok = read.repeat_interleave(sbs, dim=-1) & (pos < limit) & (pos < kv)
    q_lens = torch.tensor(lengths.q_lens, device=device).view(b, 1, 1, 1)
    ok &= torch.arange(s1, device=device).view(1, 1, -1, 1) < q_lens
    return pos.clamp(min=0), ok


def _check_valid_front(idx: Tensor, lengths: SparseLengths) -> None:
    """Wheel doc, sparse_indices: "需要保证每行有效值均在前半部分，无效值均在后半部分"."""
    b, _, s1, _ = idx.shape
    rows = torch.arange(s1, device=idx.device).view(1, 1, -1, 1)
    real = rows < torch.tensor(lengths.q_lens, device=idx.device).view(b, 1, 1, 1)
    if bool(((idx < -1) & real).any()):
        raise OpInputError(
            f"{OP}: sparse_indices holds {int(idx[real.expand_as(idx)].min())}; entries are positions >= 0 or -1 for unused slots"
        )
    invalid = idx == -1
    after_invalid = torch.cumsum(invalid.to(torch.int32), dim=-1) > 0
    misplaced = after_invalid & ~invalid & real
    if bool(misplaced.any()):
        where = misplaced.nonzero()[0].tolist()
        raise OpInputError(
            f"{OP}: sparse_indices row (request {where[0]}, head {where[1]}, query {where[2]}) has a "
            "valid position after a -1; valid entries must come first and -1 only after them"
        )


def _attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    query_rope: Tensor,
    key_rope: Tensor,
    layout_query: str,
    layout_kv: str,
    lengths: SparseLengths,
    block_table: Tensor | None,
    chosen: tuple[Tensor, Tensor],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """[B, Q_N, S1, Dv] output and [B, N2, S1, G] row max / sum, in fp32."""
    pos, ok = chosen  # [B, N2, S1, P]
    # Columns past the last one any row counts weigh nothing (-1 entries sit at the end of
    # every row, and a block entry's tokens past the causal limit are masked): dropping them
    # keeps the result and spares gathering sparse_count (2048) rows per query when the
    # context is short. One column stays, so the reductions below have a dimension.
    counted = ok.flatten(0, -2).any(dim=0).nonzero()
    used = int(counted[-1]) + 1 if counted.numel() else 1
    pos, ok = pos[..., :used], ok[..., :used]
    q = padded_query(query, layout_query, lengths.q_lens, "query").float()  # [B, N1, S1, D]
    qr = padded_query(query_rope, layout_query, lengths.q_lens, "query_rope").float()
    k = padded_keys(key, layout_kv, lengths, block_table, "key").float()  # [B, N2, S2, D]
    kr = padded_keys(key_rope, layout_kv, lengths, block_table, "key_rope").float()
    v = k if value is key else padded_keys(value, layout_kv, lengths, block_table, "value").float()
    b, n1, s1, _ = q.shape
    n2, s2 = k.size(1), k.size(2)
    g = n1 // n2
    flat = pos.clamp(max=max(s2 - 1, 0)).view(b, n2, -1)  # [B, N2, S1*P]

    def gather(x: Tensor) -> Tensor:  # [B, N2, S2, D] -> [B, N2, S1, P, D]
        if s2 == 0:
            return x.new_zeros((*pos.shape, x.size(-1)))
        rows = torch.gather(x, 2, flat.unsqueeze(-1).expand(-1, -1, -1, x.size(-1)))
        return rows.view(*pos.shape, x.size(-1))

    kg, krg = gather(k), gather(kr)
    vg = kg if v is k else gather(v)
    qg, qrg = q.view(b, n2, g, s1, -1), qr.view(b, n2, g, s1, -1)
    s = torch.einsum("bngsd,bnspd->bngsp", qg, kg) + torch.einsum("bngsd,bnspd->bngsp", qrg, krg)
    s = (s * scale).masked_fill(~ok.unsqueeze(2), float("-inf"))  # [B, N2, G, S1, P]
    any_key = ok.any(dim=-1).unsqueeze(2)  # [B, N2, 1, S1]
    row_max = torch.where(any_key, s.amax(dim=-1), 0.0)
    p = torch.exp(s - row_max.unsqueeze(-1)).masked_fill(~ok.unsqueeze(2), 0.0)
    row_sum = p.sum(dim=-1)
    probs = p / torch.where(any_key, row_sum, 1.0).unsqueeze(-1)
    out = torch.einsum("bngsp,bnspd->bngsd", probs, vg).reshape(b, n1, s1, -1)
    # [B, N2, G, S1] -> [B, N2, S1, G]
    return out, row_max.transpose(2, 3), row_sum.transpose(2, 3)


def _lse_layout(x: Tensor, layout_query: str, lengths: SparseLengths) -> Tensor:
    """[B, N2, S1, G] -> BSND [B, N2, S1, G] or TND [N2, T, G] (meta registration shapes)."""
    if layout_query == "BSND":
        return x.contiguous()
    return padded_to_packed(x, lengths.q_lens).transpose(0, 1).contiguous()
