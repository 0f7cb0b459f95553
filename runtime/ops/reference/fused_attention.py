"""The shared body of FA v1 and v2: argument validation, branch choice, masking, layouts.

The two signature layers (``fused_infer_attention``) translate their keyword names into an
``FaCall`` and hand it to ``run``. Error messages use the caller's own keyword names, so a v2
user reads ``actual_seq_qlen`` and a v1 user ``actual_seq_lengths``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import INT_MAX, OpInputError, ReferenceUnsupportedError, describe, int_list
from .attention_core import Admission, attention
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

#: side of the compressed causal tile that sparse modes 2/3/4 take (npu_ops.md §1.5)
COMPRESSED_MASK_SIZE = 2048
MLA_ROPE_DIM = 64
MLA_NOPE_DIMS = (512, 128)
MAX_GQA_RATIO = 64
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


@dataclass(frozen=True, slots=True)
class Names:
    """The keyword names one operator version uses, for error messages."""

    op: str
    num_heads: str
    q_lens: str
    kv_lens: str
    scale: str


@dataclass(slots=True)
class FaCall:
    """One fused-attention call in version-neutral terms."""

    names: Names
    query: Tensor
    key: Tensor
    value: Tensor
    query_rope: Tensor | None
    key_rope: Tensor | None
    pse_shift: Tensor | None
    atten_mask: Tensor | None
    q_lens_arg: object
    kv_lens_arg: object
    block_table: Tensor | None
    num_heads: int
    num_key_value_heads: int
    scale: float
    pre_tokens: int
    next_tokens: int
    input_layout: str
    sparse_mode: int
    block_size: int
    inner_precise: int
    return_lse: bool
    learnable_sink: Tensor | None = None


@dataclass(frozen=True, slots=True)
class _Shapes:
    batch: int
    q_lens: list[int]
    kv_lens: list[int]
    decode_branch: bool


def run(call: FaCall) -> tuple[Tensor, Tensor]:
    """Validate, gather and compute; returns (attention_out, softmax_lse)."""
    nm = call.names
    layout = Layout.parse(call.input_layout)
    if call.num_heads <= 0:
        raise OpInputError(f"{nm.op}: {nm.num_heads} must be > 0, got {call.num_heads}")
    kvn = call.num_key_value_heads or call.num_heads
    if call.num_heads % kvn or call.num_heads // kvn > MAX_GQA_RATIO:
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
    shapes = _resolve_lengths(call, layout, paged)
    admission = _admission(call, shapes, paged)
    q, q_rope = _padded_query(call, layout, shapes)
    k, v, k_rope = _padded_kv(call, layout, shapes, kvn, paged)
    if q.size(-1) != k.size(-1):
        raise OpInputError(
            f"{nm.op}: query head dim {q.size(-1)} differs from key head dim {k.size(-1)}"
        )
    sink = _check_sink(call, layout, v.size(-1))
    device = q.device
    out, lse = attention(
        q,
        k,
        v,
        q_lens=torch.tensor(shapes.q_lens, dtype=torch.int64, device=device),
        kv_lens=torch.tensor(shapes.kv_lens, dtype=torch.int64, device=device),
        scale=float(call.scale),
        admission=admission,
        q_rope=q_rope,
        k_rope=k_rope,
        sink=sink,
        pse_shift=call.pse_shift,
        need_lse=call.return_lse,
    )
    attention_out = format_output(out.to(call.query.dtype), layout, shapes.q_lens)
    if call.return_lse:
        softmax_lse = format_lse(lse, layout, shapes.q_lens)
    else:
        # Never read: an empty fp32 tensor, as torch_npu >= 7.2 returns (npu_ops.md §1.9).
        softmax_lse = torch.empty(0, dtype=torch.float32, device=device)
    return attention_out, softmax_lse


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


def _resolve_lengths(call: FaCall, layout: Layout, paged: bool) -> _Shapes:
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
        q_lens = _from_cumulative(nm.op, nm.q_lens, q_arg, total_q, "T")
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
            q_lens = _per_batch(nm.op, nm.q_lens, q_arg, batch, limit=seq)
    if paged:
        kv_lens = _paged_kv_lens(call, layout, batch, kv_arg)
    elif layout.is_packed:
        if kv_arg is None:
            raise OpInputError(
                f"{nm.op}: input_layout {call.input_layout!r} without block_table requires "
                f"{nm.kv_lens} (cumulative key lengths)"
            )
        total_kv = call.key.size(0 if layout.query == "TND" else 1)
        kv_lens = _from_cumulative(nm.op, nm.kv_lens, kv_arg, total_kv, "T_kv")
        if len(kv_lens) != batch:
            raise OpInputError(
                f"{nm.op}: {nm.kv_lens} has {len(kv_lens)} entries but {nm.q_lens} has {batch}"
            )
    else:
        kv_seq = call.key.size(2 if layout.query == "BNSD" else 1)
        kv_lens = [kv_seq] * batch if kv_arg is None else None
        if kv_lens is None:
            kv_lens = _per_batch(nm.op, nm.kv_lens, kv_arg, batch, limit=kv_seq)
    return _Shapes(batch=batch, q_lens=q_lens, kv_lens=kv_lens, decode_branch=decode_branch)


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
        kv_lens = _per_batch(nm.op, nm.kv_lens, kv_arg, batch, limit=None)
    capacity = bt.size(1) * cache_bs
    for b, n in enumerate(kv_lens):
        if n < 0 or n > capacity:
            raise OpInputError(
                f"{nm.op}: {nm.kv_lens}[{b}]={n} does not fit the block table "
                f"({bt.size(1)} blocks x {cache_bs} = {capacity} tokens); with paged KV the "
                f"kv lengths are per request, not cumulative"
            )
    return kv_lens


def _from_cumulative(op: str, name: str, cum: list[int], total: int, total_name: str) -> list[int]:
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


def _per_batch(op: str, name: str, lens: list[int], batch: int, limit: int | None) -> list[int]:
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


def _admission(call: FaCall, shapes: _Shapes, paged: bool) -> Admission:
    """Masking rule for this call; validates the mask against the sparse mode (§1.5)."""
    nm = call.names
    mode = call.sparse_mode
    mask = call.atten_mask
    if mask is not None and mask.dtype not in _MASK_DTYPES:
        raise OpInputError(
            f"{nm.op}: atten_mask must be bool, int8 or uint8 (True/1 = masked out), got "
            f"{describe(mask)}; float masks are rejected"
        )
    if mode == 9:
        raise ReferenceUnsupportedError(
            f"{nm.op}: sparse_mode=9 (tree mask) is not supported by the reference backend"
        )
    if mode not in (0, 1, 2, 3, 4):
        raise OpInputError(f"{nm.op}: sparse_mode must be one of 0..4 here, got {mode}")
    if shapes.decode_branch:
        return _decode_admission(call, shapes, paged)
    if mode in (2, 3, 4):
        _check_compressed_mask(nm, mode, mask, exact_2d=False)
        pre, nxt = call.pre_tokens, call.next_tokens
        if mode == 4:
            _check_window(nm, pre, nxt, shapes, mode)
        return Admission(sparse_mode=mode, pre_tokens=pre, next_tokens=nxt)
    if mask is None:
        if mode == 1:
            raise OpInputError(f"{nm.op}: sparse_mode=1 needs atten_mask (Q_S x KV_S), got None")
        # Mode 0 without a mask ignores pre/next_tokens (the operator forces them to INT_MAX).
        return Admission(sparse_mode=0)
    full = _full_mask(call, shapes, mask)
    pre, nxt = (call.pre_tokens, call.next_tokens) if mode == 0 else (INT_MAX, INT_MAX)
    if mode == 0:
        _check_window(nm, pre, nxt, shapes, mode)
    return Admission(sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, user_mask=full)


def _check_window(nm: Names, pre: int, nxt: int, shapes: _Shapes, mode: int) -> None:
    """Window arguments the tiling check rejects (npu_ops.md §1.5, prefill branch)."""
    if pre < 0 and nxt < 0:
        raise OpInputError(f"{nm.op}: pre_tokens={pre} and next_tokens={nxt} are both negative")
    if -nxt > pre:
        raise OpInputError(
            f"{nm.op}: -next_tokens ({-nxt}) > pre_tokens ({pre}) leaves every row empty"
        )
    if mode != 0:
        return
    for b, (s1, s2) in enumerate(zip(shapes.q_lens, shapes.kv_lens, strict=True)):
        if nxt < 0 and -nxt >= s1 > 0:
            raise OpInputError(
                f"{nm.op}: next_tokens={nxt} with query length {s1} (request {b}) masks every row"
            )
        if pre < 0 and -pre >= s2 > 0:
            raise OpInputError(
                f"{nm.op}: pre_tokens={pre} with kv length {s2} (request {b}) masks every row"
            )


def _check_compressed_mask(nm: Names, mode: int, mask: Tensor | None, exact_2d: bool) -> None:
    size = COMPRESSED_MASK_SIZE
    allowed = [(size, size)] if exact_2d else [(size, size), (1, size, size), (1, 1, size, size)]
    if mask is None:
        raise OpInputError(
            f"{nm.op}: sparse_mode={mode} needs atten_mask, the compressed bool tile of shape "
            f"({size}, {size}) = triu(ones, diagonal=1); got None"
        )
    if tuple(mask.shape) not in allowed:
        raise OpInputError(
            f"{nm.op}: sparse_mode={mode} needs atten_mask of shape "
            f"{' or '.join(map(str, allowed))}, got {describe(mask)}"
        )
    if not _is_causal_tile(mask):
        # The device reads only the tile's pattern; a different pattern would attend
        # differently there than here, so refuse it instead of guessing.
        raise OpInputError(
            f"{nm.op}: sparse_mode={mode} atten_mask must be triu(ones({size}, {size}), "
            f"diagonal=1) (True above the diagonal); got a different pattern"
        )


_TILE_CHECKED: dict[tuple[int, int, str], bool] = {}


def _is_causal_tile(mask: Tensor) -> bool:
    """Whether ``mask`` holds the triu(diagonal=1) pattern; the full check runs once per tensor.

    Inference tensors have no version counter, so for them the cache key is the storage
    address alone, backed by a cheap spot check of a few rows on every call.
    """
    version = -1 if mask.is_inference() else mask._version
    key = (mask.data_ptr(), version, str(mask.dtype))
    if version == -1 and not _spot_check(mask):
        return False
    hit = _TILE_CHECKED.get(key)
    if hit is None:
        m = mask.reshape(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE).bool()
        expected = torch.ones_like(m).triu_(diagonal=1)
        hit = bool(torch.equal(m, expected))
        if len(_TILE_CHECKED) > 64:
            _TILE_CHECKED.clear()
        _TILE_CHECKED[key] = hit
    return hit


def _spot_check(mask: Tensor) -> bool:
    m = mask.reshape(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE)
    rows = torch.tensor([0, COMPRESSED_MASK_SIZE // 2, COMPRESSED_MASK_SIZE - 1])
    cols = torch.arange(COMPRESSED_MASK_SIZE).view(1, -1)
    return bool(torch.equal(m[rows].bool(), cols > rows.view(-1, 1)))


def _full_mask(call: FaCall, shapes: _Shapes, mask: Tensor) -> Tensor:
    """A mode 0/1 mask as bool [B or 1, S1', S2'] (local coordinates, True = masked)."""
    nm = call.names
    batch = shapes.batch
    max_q, max_kv = max(shapes.q_lens, default=0), max(shapes.kv_lens, default=0)
    shape = tuple(mask.shape)
    ok_lead = mask.dim() == 2 or (
        mask.dim() == 3
        and mask.size(0) in (1, batch)
        or mask.dim() == 4
        and mask.size(0) in (1, batch)
        and mask.size(1) == 1
    )
    if not ok_lead or mask.size(-2) < max_q or mask.size(-1) < max_kv:
        raise OpInputError(
            f"{nm.op}: sparse_mode={call.sparse_mode} atten_mask must be (Q_S, KV_S), "
            f"(B or 1, Q_S, KV_S) or (B or 1, 1, Q_S, KV_S) with Q_S >= {max_q} and "
            f"KV_S >= {max_kv} (B = {batch}); got shape {shape}"
        )
    # unconfirmed: how the packed (TND) path indexes a full user mask; the reference uses
    # request-local coordinates, as for the padded layouts.
    m = mask.bool()
    if m.dim() == 2:
        return m.unsqueeze(0)
    if m.dim() == 4:
        return m[:, 0]
    return m


def _decode_admission(call: FaCall, shapes: _Shapes, paged: bool) -> Admission:
    """Single-query kernel: sparse_mode/pre/next ignored; optional per-request key mask (§1.5)."""
    nm = call.names
    mode, mask = call.sparse_mode, call.atten_mask
    if mask is None:
        return Admission(decode_branch=True)
    if mode in (3, 4):
        # The decode kernel checks the compressed tile's shape but the single newest query row
        # sees every key < kv length anyway (bottom-right causal).
        _check_compressed_mask(nm, mode, mask, exact_2d=True)
        return Admission(decode_branch=True)
    if mode == 2:
        # unconfirmed: most likely rejected on device by the "mask batch must equal B" check.
        raise OpInputError(
            f"{nm.op}: sparse_mode=2 with a single query token (decode kernel) is rejected; use "
            f"sparse_mode=3, or a TND layout"
        )
    batch = shapes.batch
    need = call.block_table.size(1) * call.block_size if paged else max(shapes.kv_lens, default=0)
    shape = tuple(mask.shape)
    lead_ok = mask.dim() in (2, 3, 4) and all(s == 1 for s in shape[1:-1])
    if not lead_ok or mask.size(0) != batch or mask.size(-1) < need:
        raise OpInputError(
            f"{nm.op}: with one query token per request atten_mask must be (B, KV_S), "
            f"(B, 1, KV_S) or (B, 1, 1, KV_S) with B = {batch} and KV_S >= {need}; got {shape}"
        )
    return Admission(decode_branch=True, key_mask=mask.reshape(batch, -1).bool())


def _padded_query(call: FaCall, layout: Layout, shapes: _Shapes) -> tuple[Tensor, Tensor | None]:
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
    call: FaCall, layout: Layout, shapes: _Shapes, kvn: int, paged: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    nm = call.names
    key, value, key_rope = call.key, call.value, call.key_rope
    if paged:
        if layout.query in ("BSH", "BSND") and key.dim() == 4:
            raise OpInputError(
                f"{nm.op}: input_layout {call.input_layout!r} with paged KV needs the 3-D cache "
                f"[num_blocks, block_size, H] (or 5-D NZ); got {describe(key)}"
            )
        bt = call.block_table
        k = gather_paged(key, bt, shapes.kv_lens, kvn, "key")
        v = gather_paged(value, bt, shapes.kv_lens, kvn, "value")
        kr = (
            gather_paged(key_rope, bt, shapes.kv_lens, kvn, "key_rope")
            if key_rope is not None
            else None
        )
        return k, v, kr
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
