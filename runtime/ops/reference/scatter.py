"""In-place cache writes: npu_scatter_nd_update_ and scatter_update_ (plus out-of-place twins)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import OpInputError, describe
from .graph_ops import compiling, register


def npu_scatter_nd_update_(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:  # noqa: A002
    """ScatterNdUpdate in place: ``input[tuple(indices[r])] = updates[r]``; returns ``input``.

    ``indices`` [..., a] (int32/int64) addresses the first ``a`` dims of ``input``; ``updates``
    has shape ``indices.shape[:-1] + input.shape[a:]``. Paged-cache use: ``cache.view(-1, N, D)``,
    ``slot_mapping.view(-1, 1)``, ``k`` [T, N, D]. Duplicate indices: undefined winner on device.

    NOTE: the device does not bound-check; negative ids (vLLM's -1 padding) are out of range
    there. The reference rejects them so the mistake surfaces here instead of as corruption.
    """
    if compiling():
        _check_nd(input, indices, updates)  # shapes and dtypes only: nothing read from device
        _SCATTER_ND_UPDATE_OP(input, indices, updates)
        return input
    _scatter_nd_update_in_place(input, indices, updates)
    return input


def _scatter_nd_update_in_place(input: Tensor, indices: Tensor, updates: Tensor) -> None:  # noqa: A002
    """npu_scatter_nd_update_'s checks and write (the registered operator's body)."""
    _check_nd(input, indices, updates)
    a = indices.size(-1)
    flat = indices.reshape(-1, a)
    if flat.numel():
        if a == 1:
            lo, hi = (int(x) for x in torch.aminmax(flat))
            out_of_range = lo < 0 or hi >= input.size(0)
        else:
            low, high = torch.aminmax(flat, dim=0)
            lo = int(low.min())
            out_of_range = lo < 0 or any(
                h >= n for h, n in zip(high.tolist(), input.shape[:a], strict=True)
            )
        if out_of_range:
            raise OpInputError(
                f"npu_scatter_nd_update_: indices out of range for input of shape "
                f"{tuple(input.shape)} (min {lo}); slice padded slot ids (-1) away first"
            )
    src = updates.reshape(flat.size(0), *input.shape[a:])
    if a == 1:
        # The paged-cache write (one slot id per token): one row copy per index.
        input.index_copy_(0, flat[:, 0].long(), src)
    else:
        input.index_put_(tuple(flat.long().unbind(-1)), src)


def _scatter_nd_update_fake(input: Tensor, indices: Tensor, updates: Tensor) -> None:  # noqa: A002
    return None


#: kvskill::scatter_nd_update_, which writes ``input`` and returns nothing
_SCATTER_ND_UPDATE_OP = register(
    "scatter_nd_update_",
    _scatter_nd_update_in_place,
    _scatter_nd_update_fake,
    mutates_args=("input",),
)


def npu_scatter_nd_update(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:  # noqa: A002
    """Out-of-place twin of ``npu_scatter_nd_update_``."""
    return npu_scatter_nd_update_(input.clone(), indices, updates)


def _check_nd(input: Tensor, indices: Tensor, updates: Tensor) -> None:  # noqa: A002
    # doc npu_scatter_nd_update_, 参数说明 › input: "数据类型需要与updates一致，维度只能是1~8维"
    if not 1 <= input.dim() <= 8:
        raise OpInputError(
            f"npu_scatter_nd_update_: input must have 1..8 dims, got {describe(input)}"
        )
    if updates.dtype != input.dtype:
        raise OpInputError(
            f"npu_scatter_nd_update_: updates dtype {updates.dtype} must equal the input's "
            f"{input.dtype}; cast the new keys/values to the cache dtype first"
        )
    if indices.is_floating_point() or indices.dim() < 2:
        raise OpInputError(
            f"npu_scatter_nd_update_: indices must be int32/int64 with rank >= 2, got "
            f"{describe(indices)}"
        )
    a = indices.size(-1)
    if not 1 <= a <= input.dim():
        raise OpInputError(
            f"npu_scatter_nd_update_: indices last dim {a} must be in [1, input.dim() = "
            f"{input.dim()}]"
        )
    expected = tuple(indices.shape[:-1]) + tuple(input.shape[a:])
    if tuple(updates.shape) != expected:
        raise OpInputError(
            f"npu_scatter_nd_update_: updates must have shape indices.shape[:-1] + "
            f"input.shape[{a}:] = {expected}, got {tuple(updates.shape)}"
        )


def scatter_update_(input: Tensor, indices: Tensor, updates: Tensor, axis: int) -> Tensor:  # noqa: A002
    """Write ``updates[i]`` into batch ``i`` of ``input`` along ``axis`` at offset ``indices[i]``.

    1-D indices (n,): ``input[i, ..., indices[i] + k, ...] = updates[i, ..., k, ...]``.
    2-D indices (n, 2): row i writes batch ``indices[i, 0]`` at offset ``indices[i, 1]``.
    Example: BNSD cache (B, N, S_max, D), ``indices = kv_len``,
    updates (B, N, 1, D), ``axis=-2`` appends one token per request. Returns ``input``.

    NOTE: the schema names the first parameter ``self`` (bound as ``input``); the wheel's docs
    still call it ``data``, which the binding does not accept as a keyword.
    """
    data = input
    rank = data.dim()
    _check_update_inputs(data, indices, updates)
    if not -rank < axis < rank or axis % rank == 0:
        raise OpInputError(
            f"scatter_update_: axis must be in (-{rank}, {rank}) and not 0, got {axis}"
        )
    axis %= rank
    if updates.dim() != rank:
        raise OpInputError(
            f"scatter_update_: updates rank {updates.dim()} must equal data rank {rank}"
        )
    idx = indices.long()
    n = idx.size(0)
    if idx.dim() == 2:
        batch, offset = idx[:, 0], idx[:, 1]
    else:
        batch, offset = torch.arange(n, device=idx.device), idx
    for d in range(1, rank):
        if d != axis and data.size(d) != updates.size(d):
            raise OpInputError(
                f"scatter_update_: dim {d} of updates ({updates.size(d)}) must equal data's "
                f"({data.size(d)})"
            )
    if updates.size(0) != n:
        raise OpInputError(
            f"scatter_update_: updates has {updates.size(0)} rows but indices address {n}"
        )
    length = updates.size(axis)
    if n and (int(offset.min()) < 0 or int(offset.max()) + length > data.size(axis)):
        raise OpInputError(
            f"scatter_update_: offset + length ({length}) must fit data.shape[{axis}] = "
            f"{data.size(axis)}; offsets {offset.tolist()[:8]}"
        )
    # Move the write axis next to the batch axis: views, so the write lands in ``data``.
    dst = data.movedim(axis, 1)
    src = updates.movedim(axis, 1).to(data.dtype)
    pos = offset.view(-1, 1) + torch.arange(length, device=idx.device).view(1, -1)
    dst[batch.view(-1, 1), pos] = src
    return data


#: dtypes the device documents for data/updates (Atlas A2/A3)
SCATTER_UPDATE_DTYPES = (torch.int8, torch.float16, torch.float32, torch.bfloat16, torch.int32)


def _check_update_inputs(data: Tensor, indices: Tensor, updates: Tensor) -> None:
    """The documented limits of scatter_update_ (doc 参数说明 and 约束说明)."""
    # "data只支持2-8维"; "indices ... 数据类型支持int32、int64; 目前仅支持一维跟二维"
    if not 2 <= data.dim() <= 8:
        raise OpInputError(f"scatter_update_: input must have 2..8 dims, got {describe(data)}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() not in (1, 2):
        raise OpInputError(
            f"scatter_update_: indices must be a 1-D or 2-D int32/int64 tensor, got "
            f"{describe(indices)}"
        )
    for name, t in (("input", data), ("updates", updates)):
        if t.dtype not in SCATTER_UPDATE_DTYPES:
            raise OpInputError(
                f"scatter_update_: {name} dtype must be one of "
                f"{[str(d).removeprefix('torch.') for d in SCATTER_UPDATE_DTYPES]}, got {t.dtype}"
            )
        # "不支持空Tensor"
        if t.numel() == 0:
            raise OpInputError(f"scatter_update_: {name} must not be empty, got {describe(t)}")
    if indices.numel() == 0:
        raise OpInputError("scatter_update_: indices must not be empty")


def scatter_update(input: Tensor, indices: Tensor, updates: Tensor, axis: int) -> Tensor:  # noqa: A002
    """Out-of-place twin of ``scatter_update_``."""
    return scatter_update_(input.clone(), indices, updates, axis)
