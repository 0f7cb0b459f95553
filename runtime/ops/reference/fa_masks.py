"""Masking arguments of the fused attention: sparse_mode, atten_mask, pre/next_tokens (§1.5).

Validates the mask against the mode and the kernel branch, and builds the ``Admission`` rule
the attention core applies.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import INT_MAX, OpInputError, ReferenceUnsupportedError, describe
from .attention_core import Admission
from .fa_call import COMPRESSED_MASK_SIZE, MASK_DTYPES, FaCall, Names, Shapes


def admission(call: FaCall, shapes: Shapes, paged: bool) -> Admission:
    """Masking rule for this call; validates the mask against the sparse mode (§1.5)."""
    nm = call.names
    mode = call.sparse_mode
    mask = call.atten_mask
    if mask is not None and mask.dtype not in MASK_DTYPES:
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


def _check_window(nm: Names, pre: int, nxt: int, shapes: Shapes, mode: int) -> None:
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


_SPOT_ROWS = (0, COMPRESSED_MASK_SIZE // 2, COMPRESSED_MASK_SIZE - 1)
_SPOT_EXPECTED = torch.arange(COMPRESSED_MASK_SIZE).view(1, -1) > torch.tensor(_SPOT_ROWS).view(
    -1, 1
)


def _spot_check(mask: Tensor) -> bool:
    """Three rows of the tile hold the causal pattern (a cheap re-check on every call)."""
    m = mask.reshape(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE)
    return bool(torch.equal(m[list(_SPOT_ROWS)].bool().cpu(), _SPOT_EXPECTED))


def _full_mask(call: FaCall, shapes: Shapes, mask: Tensor) -> Tensor:
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


def _decode_admission(call: FaCall, shapes: Shapes, paged: bool) -> Admission:
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
