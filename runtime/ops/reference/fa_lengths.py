"""Sequence-length arguments of the fused attention: which form each layout wants (§1.3).

TND/NTD queries take cumulative query lengths (no leading 0, last = T); kv lengths are
cumulative without paging and per request with paging. Padded layouts take per-request
lengths (one value = shared by all requests); with one query token the query lengths are
ignored.
"""

from __future__ import annotations

from torch import Tensor

from ._checks import OpInputError, describe, int_list
from .attention_inputs import Layout, paged_block_size
from .fa_call import FaCall, Shapes


def resolve_lengths(call: FaCall, layout: Layout, paged: bool) -> Shapes:
    """Per-request query and kv lengths from the layout and the length arguments (§1.3)."""
    nm = call.names
    q_arg = int_list(nm.q_lens, call.q_lens_arg)
    kv_arg = int_list(nm.kv_lens, call.kv_lens_arg)
    if layout.is_packed:
        total_q = call.query.size(0 if layout.query == "TND" else 1)
        if q_arg is None:
            raise OpInputError(
                f"{nm.op}: input_layout {call.input_layout!r} requires {nm.q_lens} "
                f"(cumulative query lengths without a leading 0, last = T = {total_q})"
            )
        bt = call.block_table
        if paged and isinstance(bt, Tensor) and len(q_arg) == bt.size(0) + 1 and q_arg[0] == 0:
            raise OpInputError(
                f"{nm.op}: {nm.q_lens} has a leading 0 ({_short(q_arg)}); the operator wants "
                f"the cumulative ends only, e.g. query_start_loc[1:]"
            )
        q_lens = from_cumulative(nm.op, nm.q_lens, q_arg, total_q, "T")
        batch = len(q_lens)
        decode_branch = False
    else:
        batch = call.query.size(0)
        seq = call.query.size(2 if layout.query == "BNSD" else 1)
        decode_branch = seq == 1 and call.query_rope is None
        if decode_branch or q_arg is None:
            # Decode branch: the operator ignores the query lengths (npu_ops.md §1.4).
            q_lens = [seq] * batch
        else:
            q_lens = per_batch(nm.op, nm.q_lens, q_arg, batch, limit=seq)
    if paged:
        kv_lens = _paged_kv_lens(call, layout, batch, kv_arg)
    elif layout.is_packed:
        if kv_arg is None:
            raise OpInputError(
                f"{nm.op}: input_layout {call.input_layout!r} without block_table requires "
                f"{nm.kv_lens} (cumulative key lengths)"
            )
        total_kv = call.key.size(0 if layout.query == "TND" else 1)
        kv_lens = from_cumulative(nm.op, nm.kv_lens, kv_arg, total_kv, "T_kv")
        if len(kv_lens) != batch:
            raise OpInputError(
                f"{nm.op}: {nm.kv_lens} has {len(kv_lens)} entries but {nm.q_lens} has {batch}"
            )
    else:
        kv_seq = call.key.size(2 if layout.query == "BNSD" else 1)
        kv_lens = [kv_seq] * batch if kv_arg is None else None
        if kv_lens is None:
            kv_lens = per_batch(nm.op, nm.kv_lens, kv_arg, batch, limit=kv_seq)
    return Shapes(batch=batch, q_lens=q_lens, kv_lens=kv_lens, decode_branch=decode_branch)


def _paged_kv_lens(call: FaCall, layout: Layout, batch: int, kv_arg: list[int] | None) -> list[int]:
    nm = call.names
    bt = call.block_table
    if not isinstance(bt, Tensor) or bt.dim() != 2 or bt.is_floating_point():
        raise OpInputError(
            f"{nm.op}: block_table must be a 2-D int32 tensor [B, max_blocks], got {describe(bt)}"
        )
    if bt.size(0) != batch:
        raise OpInputError(
            f"{nm.op}: block_table has {bt.size(0)} rows but the query holds {batch} requests"
        )
    if kv_arg is None:
        raise OpInputError(f"{nm.op}: paged KV (block_table given) requires {nm.kv_lens}")
    cache_bs = paged_block_size(call.key)
    if call.block_size != cache_bs:
        raise OpInputError(
            f"{nm.op}: block_size={call.block_size} but the paged key cache {describe(call.key)} "
            f"has block size {cache_bs}"
        )
    if layout.is_packed:
        if len(kv_arg) != batch:
            raise OpInputError(
                f"{nm.op}: {nm.kv_lens} must hold one kv length per request ({batch}), got "
                f"{len(kv_arg)} ({_short(kv_arg)})"
            )
        kv_lens = kv_arg
    else:
        kv_lens = per_batch(nm.op, nm.kv_lens, kv_arg, batch, limit=None)
    capacity = bt.size(1) * cache_bs
    for b, n in enumerate(kv_lens):
        if n < 0 or n > capacity:
            raise OpInputError(
                f"{nm.op}: {nm.kv_lens}[{b}]={n} does not fit the block table "
                f"({bt.size(1)} blocks x {cache_bs} = {capacity} tokens); with paged KV the "
                f"kv lengths are per request, not cumulative"
            )
    return kv_lens


def from_cumulative(op: str, name: str, cum: list[int], total: int, total_name: str) -> list[int]:
    if not cum:
        raise OpInputError(f"{op}: {name} is empty; expected cumulative lengths ending at {total}")
    prev = 0
    lens = []
    for x in cum:
        if x < prev:
            raise OpInputError(
                f"{op}: {name}={_short(cum)} must be cumulative (non-decreasing prefix sums, "
                f"no leading 0, last = {total_name} = {total}); it decreases"
            )
        lens.append(x - prev)
        prev = x
    if prev != total:
        raise OpInputError(
            f"{op}: {name}={_short(cum)} must be cumulative with last value = {total_name} = "
            f"{total}, got last value {prev} (per-request lengths given instead?)"
        )
    return lens


def per_batch(op: str, name: str, lens: list[int], batch: int, limit: int | None) -> list[int]:
    """Per-batch lengths: one value shared by all requests, or the first ``batch`` values."""
    if len(lens) == 1:
        lens = lens * batch
    elif len(lens) < batch:
        raise OpInputError(
            f"{op}: {name} has {len(lens)} entries ({_short(lens)}); expected 1 or >= B = {batch}"
        )
    lens = lens[:batch]
    for b, n in enumerate(lens):
        if n < 0 or (limit is not None and n > limit):
            raise OpInputError(f"{op}: {name}[{b}]={n} is outside [0, {limit}]")
    return lens


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"


def graph_lengths(value: object) -> tuple[list[int] | None, Tensor | None]:
    """A length argument split for the registered operator's two slots: a list (its ints
    symbolic while traced) or a 1-D tensor the operator reads when the graph runs."""
    if isinstance(value, Tensor):
        return None, value
    return (None if value is None else list(value)), None
