"""Layouts and lengths of the DSA operators (lightning indexer, sparse flash attention).

Both take a query in BSND or TND and keys in BSND, TND or PA_BSND (paged), with lengths as
int32 tensors (``Tensor?`` in the schema, not ``SymInt[]`` as in the fused attention):

    layout     query / key shape                lengths argument
    BSND       [B, S, N, D]                     per request; None = S for every request
    TND        [T, N, D]                        cumulative (prefix sums, no leading 0), required
    PA_BSND    [block_num, block_size, N, D]    per request, required; block_table [B, >= blocks]

In PA_BSND, token t of request b lives in ``key[block_table[b, t // block_size], t %
block_size]``; indices the operators return or take are logical positions in the request
(0 .. kv_len - 1), never slots of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._checks import OpInputError, describe, int_list
from .attention_inputs import gather_paged, packed_to_padded, padded_to_packed
from .fa_lengths import from_cumulative, per_batch

QUERY_LAYOUTS = ("BSND", "TND")
KEY_LAYOUTS = ("BSND", "TND", "PA_BSND")
PAGED = "PA_BSND"


@dataclass(frozen=True, slots=True)
class SparseLengths:
    """Per-request query and key lengths of one call."""

    q_lens: list[int]
    kv_lens: list[int]

    @property
    def batch(self) -> int:
        return len(self.q_lens)


@dataclass(frozen=True, slots=True)
class LengthArgs:
    """The operator's names for its length arguments (they differ between the two operators)."""

    op: str
    q_lens: str
    kv_lens: str
    layout_kv: str


def check_layouts(names: LengthArgs, layout_query: str, layout_kv: str, block_table: Any) -> None:
    """Documented layout values and their pairing with ``block_table``."""
    op = names.op
    if layout_query not in QUERY_LAYOUTS:
        raise OpInputError(
            f"{op}: layout_query must be one of {list(QUERY_LAYOUTS)}, got {layout_query!r}"
        )
    if layout_kv not in KEY_LAYOUTS:
        raise OpInputError(
            f"{op}: {names.layout_kv} must be one of {list(KEY_LAYOUTS)}, got {layout_kv!r}"
        )
    if layout_kv == PAGED and block_table is None:
        raise OpInputError(f"{op}: {names.layout_kv}='PA_BSND' (paged keys) requires block_table")
    if layout_kv != PAGED and block_table is not None:
        raise OpInputError(
            f"{op}: block_table is given but {names.layout_kv}={layout_kv!r}; a paged cache "
            f"[block_num, block_size, N, D] is read only with {names.layout_kv}='PA_BSND'"
        )
    # docs: "在非PageAttention场景下，该参数值应与layout_query值保持一致"
    if layout_kv != PAGED and layout_kv != layout_query:
        raise OpInputError(
            f"{op}: without page attention {names.layout_kv} must equal layout_query, got "
            f"{names.layout_kv}={layout_kv!r} and layout_query={layout_query!r}"
        )


def length_tensor(op: str, name: str, value: Any) -> list[int] | None:
    """A ``Tensor?`` length argument as a list of ints (None stays None).

    The schema types these as tensors; a Python list, accepted by the fused attention's
    ``SymInt[]`` arguments, is rejected by this operator's binding, so it is rejected here.
    """
    if value is None:
        return None
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{op}(): `{name}` must be a 1-D int32 tensor (the schema types it `Tensor?`), got "
            f"{type(value).__name__}"
        )
    return int_list(name, value)


def resolve_lengths(
    names: LengthArgs,
    *,
    query: Tensor,
    key: Tensor,
    layout_query: str,
    layout_kv: str,
    q_lens_arg: Tensor | None,
    kv_lens_arg: Tensor | None,
    block_table: Tensor | None,
) -> SparseLengths:
    """Per-request lengths from the layouts and the length arguments (module docstring)."""
    op = names.op
    q_arg = length_tensor(op, names.q_lens, q_lens_arg)
    kv_arg = length_tensor(op, names.kv_lens, kv_lens_arg)
    if layout_query == "TND":
        if q_arg is None:
            raise OpInputError(
                f"{op}: layout_query 'TND' requires {names.q_lens} (cumulative query lengths, "
                f"last = T = {query.size(0)})"
            )
        q_lens = from_cumulative(op, names.q_lens, q_arg, query.size(0), "T")
    else:
        seq = query.size(1)
        q_lens = [seq] * query.size(0) if q_arg is None else None
        if q_lens is None:
            q_lens = per_batch(op, names.q_lens, q_arg, query.size(0), limit=seq)
    batch = len(q_lens)
    if layout_kv == PAGED:
        kv_lens = _paged_lengths(names, key, block_table, kv_arg, batch)
    elif layout_kv == "TND":
        if kv_arg is None:
            raise OpInputError(f"{op}: {names.layout_kv} 'TND' requires {names.kv_lens}")
        kv_lens = from_cumulative(op, names.kv_lens, kv_arg, key.size(0), "T_kv")
    else:
        if key.size(0) != batch:
            raise OpInputError(
                f"{op}: key holds {key.size(0)} requests but the query {batch}: {describe(key)}"
            )
        seq = key.size(1)
        kv_lens = [seq] * batch if kv_arg is None else None
        if kv_lens is None:
            kv_lens = per_batch(op, names.kv_lens, kv_arg, batch, limit=seq)
    if len(kv_lens) != batch:
        raise OpInputError(
            f"{op}: {names.kv_lens} describes {len(kv_lens)} requests but the query {batch}"
        )
    return SparseLengths(q_lens=q_lens, kv_lens=kv_lens)


def _paged_lengths(
    names: LengthArgs, key: Tensor, block_table: Tensor, kv_arg: list[int] | None, batch: int
) -> list[int]:
    op = names.op
    if kv_arg is None:
        raise OpInputError(f"{op}: {names.layout_kv} 'PA_BSND' requires {names.kv_lens}")
    # docs: "block_table必须为二维，第一维长度需要等于B，第二维长度不能小于maxBlockNumPerSeq"
    if not isinstance(block_table, Tensor) or block_table.dim() != 2:
        raise OpInputError(
            f"{op}: block_table must be 2-D [B, max_blocks], got {describe(block_table)}"
        )
    if block_table.is_floating_point():
        raise OpInputError(f"{op}: block_table must be int32, got {block_table.dtype}")
    if block_table.size(0) != batch:
        raise OpInputError(
            f"{op}: block_table has {block_table.size(0)} rows but the query holds {batch} requests"
        )
    if len(kv_arg) != batch:
        raise OpInputError(
            f"{op}: with 'PA_BSND' {names.kv_lens} holds one length per request ({batch}), got "
            f"{len(kv_arg)}"
        )
    block_size = key.size(1)
    capacity = block_table.size(1) * block_size
    for b, n in enumerate(kv_arg):
        if n < 0 or n > capacity:
            raise OpInputError(
                f"{op}: {names.kv_lens}[{b}]={n} does not fit the block table ({block_table.size(1)} "
                f"blocks x {block_size} = {capacity} tokens); paged lengths are per request, "
                "not cumulative"
            )
    return kv_arg


def padded_query(x: Tensor, layout_query: str, q_lens: list[int], what: str) -> Tensor:
    """A BSND / TND query-side tensor -> [B, N, max(q_lens), D]."""
    if layout_query == "TND":
        return packed_to_padded(x, q_lens, "TND", x.size(1), what)
    return x.permute(0, 2, 1, 3)


def padded_keys(
    x: Tensor,
    layout_kv: str,
    lengths: SparseLengths,
    block_table: Tensor | None,
    what: str,
) -> Tensor:
    """A BSND / TND / PA_BSND key-side tensor -> [B, N, max(kv_lens), D] in logical order."""
    if layout_kv == PAGED:
        # [block_num, block_size, N, D] is the fused attention's 3-D cache [nb, bs, N*D]
        flat = x.reshape(x.size(0), x.size(1), -1)
        return gather_paged(
            flat, block_table, lengths.kv_lens, x.size(2), what, workspace=f"sparse_{what}"
        )
    if layout_kv == "TND":
        return packed_to_padded(x, lengths.kv_lens, "TND", x.size(1), what)
    return x.permute(0, 2, 1, 3)


def query_layout(x: Tensor, layout_query: str, q_lens: list[int]) -> Tensor:
    """[B, N, S, ...] -> BSND [B, S, N, ...] or TND [T, N, ...], contiguous."""
    if layout_query == "TND":
        return padded_to_packed(x, q_lens).contiguous()
    return x.transpose(1, 2).contiguous()


def causal_limits(
    lengths: SparseLengths, sparse_mode: int, width: int, device: torch.device
) -> Tensor:
    """How many leading key positions each query row may see: [B, width] (int64).

    sparse_mode 0 sees the whole key (kv_len); sparse_mode 3 (rightDownCausal) aligns the
    last query row with the last key: row i of a request sees keys j < kv_len - q_len + i + 1.

        q_len = 3, kv_len = 5, mode 3:   row 0 -> 3 keys, row 1 -> 4, row 2 -> 5

    A negative limit (q_len > kv_len, the first rows) means no key at all.
    """
    q = torch.tensor(lengths.q_lens, device=device).view(-1, 1)
    kv = torch.tensor(lengths.kv_lens, device=device).view(-1, 1)
    rows = torch.arange(width, device=device).view(1, -1)
    if sparse_mode == 0:
        return kv.expand(-1, width).clone()
    return kv - q + rows + 1
