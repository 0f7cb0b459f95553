"""The shared body of FA v1 and v2: argument validation, branch choice, masking, layouts.

The two signature layers (``fused_infer_attention``) translate their keyword names into an
``FaCall`` and hand it to ``run``; lengths are resolved in ``fa_lengths``, masks in ``fa_masks``. Error messages use the caller's own keyword names, so a v2
user reads ``actual_seq_qlen`` and a v1 user ``actual_seq_lengths``.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from kvskill.core.npu_limits import MLA_LATENT_DIM
from torch import Tensor

from ..cpu_kernels import paged_decode
from ..cpu_kernels.paged_decode import BlockOutOfRangeError
from ._checks import BlockIdError, OpInputError, describe
from .attention_core import Admission, attention, newest_rows_only
from .attention_inputs import (
    Layout,
    dense_to_padded,
    format_lse,
    format_output,
    gather_paged,
    packed_to_padded,
    paged_block_size,
    split_heads_bsh,
)
from .batch_groups import Group, plan_groups
from .fa_call import MAX_GQA_RATIO, MLA_NOPE_DIMS, MLA_ROPE_DIM, FaCall, Shapes
from .fa_lengths import resolve_lengths
from .fa_masks import admission as build_admission
from .npu_limits import check_fused_attention
from .packed_prefill import attend_packed


def run(call: FaCall) -> tuple[Tensor, Tensor]:
    """Validate, gather and compute; returns (attention_out, softmax_lse)."""
    nm = call.names
    layout = Layout.parse(call.input_layout)
    if call.num_heads <= 0:
        raise OpInputError(f"{nm.op}: {nm.num_heads} must be > 0, got {call.num_heads}")
    kvn = call.num_key_value_heads or call.num_heads
    # 参数说明 › num_key_value_heads: "比值不能大于64"; the MLA case takes one key head under 32,
    # 64 or 128 query heads (› query_rope和key_rope参数约束: "N为32、64、128", "key的N为1"), the
    # more specific rule (npu_limits checks its head counts)
    ratio_limit = None if _mla_latent(call) else MAX_GQA_RATIO
    if call.num_heads % kvn or (ratio_limit and call.num_heads // kvn > ratio_limit):
        raise OpInputError(
            f"{nm.op}: {nm.num_heads}={call.num_heads} must be a multiple of "
            f"num_key_value_heads={kvn} with a ratio <= {MAX_GQA_RATIO}"
        )
    if call.query.dim() != _rank(layout.query):
        raise OpInputError(
            f"{nm.op}: input_layout {call.input_layout!r} needs a {_rank(layout.query)}-D "
            f"query, got {describe(call.query)}"
        )
    if call.inner_precise not in (0, 1, 2, 3):
        raise OpInputError(f"{nm.op}: inner_precise must be 0..3, got {call.inner_precise}")
    _check_rope(call)
    paged = call.block_table is not None
    shapes = resolve_lengths(call, layout, paged)
    admission = build_admission(call, shapes, paged)
    # after the mask checks, whose messages are more specific than the operator-wide limits
    check_fused_attention(call, layout, shapes)
    packed = _prefill_packed(call, layout, shapes, kvn, admission) if paged else None
    if packed is not None:
        return packed.to(call.query.dtype), _unread_lse(packed.device)
    q, q_rope = _padded_query(call, layout, shapes)
    out = _decode_in_kernel(call, layout, shapes, kvn, admission, q, q_rope) if paged else None
    groups = None if out is not None else _batch_groups(call, shapes, paged, q)
    if out is not None:
        lse = None
    elif groups is None:
        k, v, k_rope = _padded_kv(call, layout, shapes, kvn, paged)
        sink = _check_kv(call, layout, q, k, v)
        out, lse = attention(
            q,
            k,
            v,
            q_lens=shapes.q_lens,
            kv_lens=shapes.kv_lens,
            scale=float(call.scale),
            admission=admission,
            q_rope=q_rope,
            k_rope=k_rope,
            sink=sink,
            pse_shift=call.pse_shift,
            need_lse=call.return_lse,
        )
    else:
        out, lse = _attend_in_groups(call, layout, shapes, kvn, admission, q, q_rope, groups)
    attention_out = format_output(out.to(call.query.dtype), layout, shapes.q_lens)
    if call.return_lse:
        softmax_lse = format_lse(lse, layout, shapes.q_lens)
    else:
        softmax_lse = _unread_lse(q.device)
    return attention_out, softmax_lse


def _unread_lse(device: torch.device) -> Tensor:
    """The softmax_lse of a call that did not ask for it: never read, an empty fp32 tensor, as
    torch_npu >= 7.2 returns (npu_ops.md §1.9)."""
    return torch.empty(0, dtype=torch.float32, device=device)


def _decode_in_kernel(
    call: FaCall,
    layout: Layout,
    shapes: Shapes,
    kvn: int,
    admission: Admission,
    q: Tensor,
    q_rope: Tensor | None,
) -> Tensor | None:
    """The padded output of a plain paged decode from the compiled CPU kernel, else None.

    Covers what a served model's decode step asks: one query row per request that sees all
    of its kv_lens[b] keys (absorbed MLA's rope part included), no lse, sink or bias. Anything
    else, and every input the operator rejects, stays on the PyTorch path below (which raises
    the operator's errors).
    """
    if call.return_lse or call.pse_shift is not None:
        return None
    if call.learnable_sink is not None or not newest_rows_only(admission, shapes.q_lens, q.size(2)):
        return None
    if layout.query in ("BSH", "BSND") and call.key.dim() == 4:
        return None  # the operator rejects this pairing; the PyTorch path says so
    try:
        return paged_decode(
            q,
            call.key,
            call.value,
            call.block_table,
            shapes.kv_lens,
            kvn,
            float(call.scale),
            q_rope=q_rope,
            key_rope_cache=call.key_rope,
        )
    except BlockOutOfRangeError as exc:
        raise OpInputError(f"{call.names.op}: {exc}") from None


def _prefill_packed(
    call: FaCall, layout: Layout, shapes: Shapes, kvn: int, admission: Admission
) -> Tensor | None:
    """The packed [T, N, Dv] output of a TND paged prefill, computed request by request.

    Covers plain bottom-right causal attention (sparse mode 3) without lse, bias, sink or
    rope parts, where every request has 1 <= q_len <= kv_len and at least one has more than
    one query row (decode batches go to the compiled kernel); else None.
    """
    if layout.query != "TND" or layout.output != "TND" or call.return_lse:
        return None
    if call.pse_shift is not None or call.learnable_sink is not None:
        return None
    if call.query_rope is not None or call.key_rope is not None or _same_view(call.value, call.key):
        return None
    if admission.decode_branch or admission.sparse_mode != 3:
        return None
    q_lens, kv_lens = shapes.q_lens, shapes.kv_lens
    if not q_lens or max(q_lens) < 2 or min(q_lens) < 1:
        return None
    if any(q > kv for q, kv in zip(q_lens, kv_lens, strict=True)):
        return None

    rows = call.query[: sum(q_lens)].float()

    def gather(table_rows: Tensor, lens: list[int], role: str) -> tuple[Tensor, Tensor]:
        # Own workspaces: the shared prefix's keys must survive the own keys' gathers.
        try:
            k = gather_paged(call.key, table_rows, lens, kvn, "key", workspace=f"key {role}")
            v = gather_paged(call.value, table_rows, lens, kvn, "value", workspace=f"value {role}")
        except BlockIdError as exc:
            raise OpInputError(f"{call.names.op}: {exc}") from None
        _check_kv(call, layout, rows.unsqueeze(0), k, v)  # head dims, as the padded path does
        return k.float(), v.float()

    table = call.block_table[: shapes.batch]
    block_size = paged_block_size(call.key)
    single = [b for b, q in enumerate(q_lens) if q == 1]
    starts = [0, *accumulate(q_lens)]  # each request's first packed row
    single_rows = torch.tensor([starts[b] for b in single]) if single else None
    out_single = (
        _one_row_requests_in_kernel(call, table, single, single_rows, kv_lens, kvn)
        if single
        else None
    )
    if out_single is None:
        return attend_packed(rows, table, q_lens, kv_lens, block_size, float(call.scale), gather)
    # the other requests' rows on the packed path, then every row where the operator puts it
    multi = [b for b, q in enumerate(q_lens) if q > 1]
    rows_multi = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in multi])
    out_multi = attend_packed(
        rows.index_select(0, rows_multi),
        table.index_select(0, torch.tensor(multi)),
        [q_lens[b] for b in multi],
        [kv_lens[b] for b in multi],
        block_size,
        float(call.scale),
        gather,
    )
    if out_multi is None:
        return None
    out = out_multi.new_empty((rows.size(0), *out_multi.shape[1:]))
    out.index_copy_(0, rows_multi, out_multi)
    out.index_copy_(0, single_rows, out_single)
    return out


def _one_row_requests_in_kernel(
    call: FaCall,
    table: Tensor,
    single: list[int],
    single_rows: Tensor,
    kv_lens: list[int],
    kvn: int,
) -> Tensor | None:
    """A prefill call's one-row requests ``single`` (decoding requests riding along with
    prompt chunks; ``single_rows``: their packed rows) through the compiled decode kernel in
    one call: [B1, N, Dv] fp32, or None where the kernel does not take the inputs (the packed
    path then takes them too).

    A request's one query row sees all of its kv_len keys, so bottom-right causal attention
    of it is the decode kernel's attention, read from the paged cache in place instead of one
    gather and one flash call per request.
    """
    q = call.query.index_select(0, single_rows).unsqueeze(2)
    try:
        out = paged_decode(
            q,
            call.key,
            call.value,
            table.index_select(0, torch.tensor(single)),
            [kv_lens[b] for b in single],
            kvn,
            float(call.scale),
        )
    except BlockOutOfRangeError as exc:
        raise OpInputError(f"{call.names.op}: {exc}") from None
    return None if out is None else out[:, :, 0]


def _check_kv(call: FaCall, layout: Layout, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """Head-dim agreement of query and key; returns the validated learnable sink."""
    if q.size(-1) != k.size(-1):
        raise OpInputError(
            f"{call.names.op}: query head dim {q.size(-1)} differs from key head dim {k.size(-1)}"
        )
    return _check_sink(call, layout, v.size(-1))


def _batch_groups(call: FaCall, shapes: Shapes, paged: bool, q: Tensor) -> tuple[Group, ...] | None:
    """Request groups for a paged call whose lengths differ enough to make padding costly.

    Only paged KV is split: its gather is per request anyway, so a group gathers just its own
    blocks up to its own longest request. A batched ``pse_shift`` stays on the one-group path.
    """
    if not paged or call.pse_shift is not None:
        return None
    return plan_groups(shapes.q_lens, shapes.kv_lens, q.size(1) * q.size(3), q.device)


def _attend_in_groups(
    call: FaCall,
    layout: Layout,
    shapes: Shapes,
    kvn: int,
    admission: Admission,
    q: Tensor,
    q_rope: Tensor | None,
    groups: tuple[Group, ...],
) -> tuple[Tensor, Tensor | None]:
    """``attention`` group by group; results land in the batch's padded [B, N, Sq, Dv] output."""
    b, n, sq, _ = q.shape
    out: Tensor | None = None
    lse: Tensor | None = None
    for group in groups:
        idx, q_lens, kv_lens = group.index, group.q_lens, group.kv_lens
        rows = max(q_lens)
        k, v, k_rope = _paged_kv(call, layout, call.block_table.index_select(0, idx), kv_lens, kvn)
        qg = q.index_select(0, idx)[:, :, :rows]
        sink = _check_kv(call, layout, qg, k, v)
        out_g, lse_g = attention(
            qg,
            k,
            v,
            q_lens=q_lens,
            kv_lens=kv_lens,
            scale=float(call.scale),
            admission=admission.for_requests(idx, shapes.batch),
            q_rope=q_rope.index_select(0, idx)[:, :, :rows] if q_rope is not None else None,
            k_rope=k_rope,
            sink=sink,
            need_lse=call.return_lse,
        )
        if out is None:
            out = out_g.new_zeros((b, n, sq, out_g.size(-1)))
            if lse_g is not None:
                lse = out_g.new_full((b, n, sq), float("-inf"))
        out[:, :, :rows].index_copy_(0, idx, out_g)
        if lse is not None:
            lse[:, :, :rows].index_copy_(0, idx, lse_g)
    assert out is not None  # plan_groups never returns an empty partition
    return out, lse


def _mla_latent(call: FaCall) -> bool:
    """The absorbed MLA case: rope parts given and a latent-wide (512) query."""
    if call.query_rope is None:
        return False
    dim = _head_dim(call.query, call.input_layout, call.num_heads, False)
    return dim == MLA_LATENT_DIM


def _rank(query_layout: str) -> int:
    return 3 if query_layout in ("BSH", "TND", "NTD") else 4


def _check_rope(call: FaCall) -> None:
    nm = call.names
    if (call.query_rope is None) != (call.key_rope is None):
        given, missing = (
            ("query_rope", "key_rope")
            if call.query_rope is not None
            else ("key_rope", "query_rope")
        )
        raise OpInputError(
            f"{nm.op}: `{given}` was passed without `{missing}`; pass both or neither"
        )
    if call.query_rope is None:
        return
    kvn = call.num_key_value_heads or call.num_heads
    paged = call.block_table is not None
    dims = {
        "query_rope": _head_dim(call.query_rope, call.input_layout, call.num_heads, False),
        "key_rope": _head_dim(call.key_rope, call.input_layout, kvn, paged),
    }
    for name, dim in dims.items():
        if dim != MLA_ROPE_DIM:
            raise OpInputError(
                f"{nm.op}: `{name}` head dim must be {MLA_ROPE_DIM}, got {dim} "
                f"(from shape {tuple(getattr(call, name).shape)})"
            )
    nope = _head_dim(call.query, call.input_layout, call.num_heads, False)
    if nope not in MLA_NOPE_DIMS:
        raise OpInputError(
            f"{nm.op}: with query_rope/key_rope the query head dim must be one of "
            f"{MLA_NOPE_DIMS}, got {nope}"
        )


def _head_dim(t: Tensor, layout: str, heads: int, paged: bool) -> int:
    """Head dim of a query-/key-side tensor given its layout or paged cache form."""
    if paged:
        if t.dim() == 3:
            return t.size(2) // heads
        if t.dim() == 5:
            return t.size(2) * t.size(4)
        return t.size(-1)
    if layout.startswith("BSH"):
        return t.size(2) // heads
    return t.size(-1)


def _padded_query(call: FaCall, layout: Layout, shapes: Shapes) -> tuple[Tensor, Tensor | None]:
    n = call.num_heads
    if layout.is_packed:
        q = packed_to_padded(call.query, shapes.q_lens, layout.query, n, "query")
        qr = call.query_rope
        if qr is not None:
            qr = packed_to_padded(qr, shapes.q_lens, layout.query, n, "query_rope")
        return q, qr
    q = dense_to_padded(call.query, layout.query, n, "query")
    qr = call.query_rope
    if qr is not None:
        qr = dense_to_padded(qr, layout.query, n, "query_rope")
    return q, qr


def _padded_kv(
    call: FaCall, layout: Layout, shapes: Shapes, kvn: int, paged: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    nm = call.names
    key, value, key_rope = call.key, call.value, call.key_rope
    if paged:
        return _paged_kv(call, layout, call.block_table, shapes.kv_lens, kvn)
    if value.dim() != call.query.dim() or key.dim() != call.query.dim():
        raise OpInputError(
            f"{nm.op}: without block_table key/value must have the query's rank "
            f"{call.query.dim()}; got key {describe(key)}, value {describe(value)}"
        )
    if layout.is_packed:
        k = packed_to_padded(key, shapes.kv_lens, layout.query, kvn, "key")
        v = packed_to_padded(value, shapes.kv_lens, layout.query, kvn, "value")
        kr = None
        if key_rope is not None:
            kr = packed_to_padded(key_rope, shapes.kv_lens, layout.query, kvn, "key_rope")
        return k, v, kr
    if layout.query == "BSH":
        k = split_heads_bsh(key, kvn, "key").permute(0, 2, 1, 3)
        v = split_heads_bsh(value, kvn, "value").permute(0, 2, 1, 3)
        kr = (
            split_heads_bsh(key_rope, kvn, "key_rope").permute(0, 2, 1, 3)
            if key_rope is not None
            else None
        )
        return k, v, kr
    k = dense_to_padded(key, layout.query, kvn, "key")
    v = dense_to_padded(value, layout.query, kvn, "value")
    kr = dense_to_padded(key_rope, layout.query, kvn, "key_rope") if key_rope is not None else None
    return k, v, kr


def _paged_kv(
    call: FaCall, layout: Layout, block_table: Tensor, kv_lens: list[int], kvn: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The requests' paged key, value (and key_rope) gathered to [B, KVN, max(kv_lens), D]."""
    key = call.key
    if layout.query in ("BSH", "BSND") and key.dim() == 4:
        raise OpInputError(
            f"{call.names.op}: input_layout {call.input_layout!r} with paged KV needs the 3-D "
            f"cache [num_blocks, block_size, H] (or 5-D NZ); got {describe(key)}"
        )
    try:
        return _gather_kv(call, block_table, kv_lens, kvn)
    except BlockIdError as exc:
        raise OpInputError(f"{call.names.op}: {exc}") from None


def _gather_kv(
    call: FaCall, block_table: Tensor, kv_lens: list[int], kvn: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    key = call.key
    k = gather_paged(key, block_table, kv_lens, kvn, "key")
    # MLA passes one latent cache as both key and value: gather it once (``v is k`` then
    # tells the attention that the values are the keys' leading dims).
    same = _same_view(call.value, key)
    v = k if same else gather_paged(call.value, block_table, kv_lens, kvn, "value")
    kr = None
    if call.key_rope is not None:
        kr = gather_paged(call.key_rope, block_table, kv_lens, kvn, "key_rope")
    return k, v, kr


def _same_view(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` view the same memory the same way."""
    if a is b:
        return True
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _check_sink(call: FaCall, layout: Layout, head_dim_v: int) -> Tensor | None:
    sink = call.learnable_sink
    if sink is None:
        return None
    nm = call.names
    if call.input_layout not in ("TND", "NTD_TND"):
        raise OpInputError(
            f"{nm.op}: learnable_sink needs input_layout 'TND' or 'NTD_TND', got "
            f"{call.input_layout!r}"
        )
    if sink.dim() != 1 or sink.size(0) != call.num_heads:
        raise OpInputError(
            f"{nm.op}: learnable_sink must be 1-D with {nm.num_heads}={call.num_heads} entries, "
            f"got {describe(sink)}"
        )
    if head_dim_v not in (64, 128):
        raise OpInputError(
            f"{nm.op}: learnable_sink needs value head dim 64 or 128, got {head_dim_v}"
        )
    return sink
