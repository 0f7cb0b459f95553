"""Rotary position embedding: torch_npu.npu_rotary_mul and npu_apply_rotary_pos_emb (2.13.0).

Both rotate pairs of channels and combine them with cos (r1) and sin (r2):

    half:        x = [x1 | x2]          ->  x_new = [-x2 | x1]
    interleave:  x = [a0, b0, a1, b1..] ->  x_new = [-b0, a0, -b1, a1, ...]
    output = cos * x + sin * x_new

Computed in fp32, returned in the input dtype. npu_apply_rotary_pos_emb writes its results into
``query`` and ``key`` and returns them, as the device does (the adapter returns its inputs).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ._checks import (
    FLOAT_DTYPES,
    OpInputError,
    ReferenceUnsupportedError,
    describe,
    require_dtype,
    require_rank,
)
from .graph_ops import capturable, compiling, register
from .npu_limits import NPU_ONLY
from .npu_profile import current_profile

#: npu_rotary_mul 约束说明 (jit_compile=False): "D < 896, 且为2的倍数"
ROTARY_MUL_MAX_DIM = 896
#: npu_apply_rotary_pos_emb on Atlas A2/A3: "shape最后一维（D）必须等于128或者64"
APPLY_ROPE_DIMS = (64, 128)


def rotate_pairs(x: Tensor, mode: str) -> Tensor:
    """``x_new`` of the formula above for fp32 ``x``."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((-b, a), dim=-1).flatten(-2)


def _rotary_mul_fake(args: SimpleNamespace) -> Tensor:
    return torch.empty_like(args.input)


@capturable("rotary_mul", _rotary_mul_fake)
def npu_rotary_mul(
    input: Tensor,  # noqa: A002
    r1: Tensor,
    r2: Tensor,
    rotary_mode: str = "half",
    rotate: Tensor | None = None,
) -> Tensor:
    """Rotary embedding of 4-D ``input`` (BNSD, BSND or SBND) with r1 = cos, r2 = sin.

    r1 and r2 broadcast to ``input`` (11SD, B1SD, 1S1D, ... in the docs). With ``rotate``
    (a [D, D] matrix) the rotation is ``input @ rotate`` instead of the mode's pair swap.
    """
    op = "npu_rotary_mul"
    if rotary_mode not in ("half", "interleave"):
        raise OpInputError(f"{op}: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        require_dtype(op, name, t, FLOAT_DTYPES)
        require_rank(op, name, t, 4, 4)
    d = input.size(-1)
    if d % 2 or d >= ROTARY_MUL_MAX_DIM:
        raise OpInputError(
            f"{op}: D must be even and < {ROTARY_MUL_MAX_DIM}, got {describe(input)}"
        )
    for name, t in (("r1", r1), ("r2", r2)):
        if _broadcast(t, input) != input.shape:
            raise OpInputError(
                f"{op}: `{name}` {tuple(t.shape)} must broadcast to input {tuple(input.shape)}"
            )
    x = input.float()
    if rotate is None:
        x_new = rotate_pairs(x, rotary_mode)
    else:
        if rotate.dim() != 2 or tuple(rotate.shape) != (d, d):
            raise OpInputError(f"{op}: `rotate` must be [{d}, {d}], got {describe(rotate)}")
        x_new = x @ rotate.float()
    return (r1.float() * x + r2.float() * x_new).to(input.dtype)


def npu_apply_rotary_pos_emb(
    query: Tensor,
    key: Tensor,
    cos: Tensor,
    sin: Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
) -> tuple[Tensor, Tensor]:
    """Rotary embedding of ``query`` and ``key`` in place; returns ``(query, key)``.

    Layout BSND: query [B, S, Nq, D], key [B, S, Nk, D], cos/sin [B, S, 1, D]; TND drops B.
    The adapter maps every layout string other than BNSD/SBND/TND to BSND, which is why the
    framework's ``layout="BSH"`` with 4-D tensors works. BNSD and SBND (Atlas 350 only) and
    the 350-only modes "interleave"/"quarter" are not modelled.
    """
    if compiling():
        _APPLY_ROTARY_OP(query, key, cos, sin, layout, rotary_mode)
        return query, key
    _apply_rotary_in_place(query, key, cos, sin, layout, rotary_mode)
    return query, key


def _apply_rotary_in_place(
    query: Tensor, key: Tensor, cos: Tensor, sin: Tensor, layout: str, rotary_mode: str
) -> None:
    """npu_apply_rotary_pos_emb's checks and writes (the registered operator's body)."""
    op = "npu_apply_rotary_pos_emb"
    if rotary_mode not in ("half", "quarter", "interleave"):
        raise OpInputError(
            f"{op}: rotary_mode must be half/quarter/interleave, got {rotary_mode!r}"
        )
    if rotary_mode != "half" or layout in ("BNSD", "SBND"):
        raise ReferenceUnsupportedError(
            f"{op}: layout {layout!r} with rotary_mode {rotary_mode!r} runs only on Atlas 350; "
            "the reference models Atlas A2/A3 (BSND or TND, 'half')"
        )
    rank = 3 if layout == "TND" else 4
    tokens = 1 if layout == "TND" else 2
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        require_dtype(op, name, t, FLOAT_DTYPES)
        require_rank(op, name, t, rank, rank)
        if t.dtype != query.dtype:
            raise OpInputError(
                f"{op}: `{name}` must have query's dtype {query.dtype}, got {t.dtype}"
            )
        if t.shape[:tokens] != query.shape[:tokens]:
            raise OpInputError(
                f"{op}: `{name}` {tuple(t.shape)} must share query's leading dims "
                f"{tuple(query.shape[:tokens])}"
            )
        if t.numel() == 0:
            raise OpInputError(f"{op}: `{name}` must not be empty on Atlas A2/A3 (不支持空Tensor)")
    d = query.size(-1)
    if (
        d % 2
        or key.size(-1) != d
        or cos.shape != sin.shape
        or cos.size(-2) != 1
        or cos.size(-1) != d
    ):
        raise OpInputError(
            f"{op}: D must be even, key must end in D={d} and cos/sin be [..., 1, {d}], got key "
            f"{tuple(key.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if current_profile().dims and d not in APPLY_ROPE_DIMS:
        raise OpInputError(f"{op}: D must be 64 or 128 on Atlas A2/A3, got {d} ({NPU_ONLY})")
    c, s = cos.float(), sin.float()
    for t in (query, key):
        x = t.float()
        t.copy_(c * x + s * rotate_pairs(x, "half"))


def _apply_rotary_fake(
    query: Tensor, key: Tensor, cos: Tensor, sin: Tensor, layout: str, rotary_mode: str
) -> None:
    return None


#: kvskill::apply_rotary_pos_emb, which writes query and key and returns nothing
_APPLY_ROTARY_OP = register(
    "apply_rotary_pos_emb",
    _apply_rotary_in_place,
    _apply_rotary_fake,
    mutates_args=("query", "key"),
)


def _broadcast(small: Tensor, big: Tensor) -> torch.Size | None:
    try:
        return torch.broadcast_shapes(small.shape, big.shape)
    except RuntimeError:
        return None
