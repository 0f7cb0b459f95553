"""Layout handling for the fused attention: query/KV layouts to padded head-major views and back.

Padded view (what ``attention_core`` consumes): ``[B, N, S, D]``. Packed layouts (TND, NTD)
are padded per request with one gather; paged KV is gathered once per call:

    block_table[b] = [7, 2, 9]   block_size = 4   kv_len[b] = 10
    token t of request b lives in physical block block_table[b, t // 4], row t % 4:
    tokens 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9 (rows 0, 1; rows 2, 3 unused)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import BlockIdError, OpInputError, ReferenceUnsupportedError, describe

#: every input_layout string the torch_npu adapter accepts (npu_ops.md §1.2), minus NSD
ACCEPTED_LAYOUTS = (
    "BSH",
    "BSND",
    "BNSD",
    "TND",
    "NTD",
    "BNSD_BSND",
    "BSH_BNSD",
    "BSND_BNSD",
    "NTD_TND",
    "BSH_NBSD",
    "BSND_NBSD",
    "BNSD_NBSD",
    "TND_NTD",
)
PACKED = ("TND", "NTD")
_QUERY_RANK = {"BSH": 3, "TND": 3, "NTD": 3, "BSND": 4, "BNSD": 4}


@dataclass(frozen=True, slots=True)
class Layout:
    """A parsed ``input_layout``: how the query is laid out and how the output must be."""

    query: str
    output: str

    @property
    def is_packed(self) -> bool:
        return self.query in PACKED

    @classmethod
    def parse(cls, text: str) -> Layout:
        if text == "NSD":
            raise ReferenceUnsupportedError(
                "input_layout 'NSD' is accepted by the operator but not supported by the "
                "reference backend"
            )
        if text not in ACCEPTED_LAYOUTS:
            raise OpInputError(
                f"input_layout {text!r} is not supported; expected one of {list(ACCEPTED_LAYOUTS)}"
            )
        query, _, output = text.partition("_")
        return cls(query=query, output=output or query)


def split_heads_bsh(x: Tensor, num_heads: int, what: str) -> Tensor:
    """[B, S, N*D] -> [B, S, N, D]."""
    if x.size(2) % num_heads:
        raise OpInputError(
            f"{what} hidden size {x.size(2)} is not divisible by its head count {num_heads}"
        )
    return x.view(x.size(0), x.size(1), num_heads, x.size(2) // num_heads)


def dense_to_padded(x: Tensor, layout: str, num_heads: int, what: str) -> Tensor:
    """A BSH / BSND / BNSD tensor -> [B, N, S, D] (a view where possible)."""
    if layout == "BSH":
        x = split_heads_bsh(x, num_heads, what)
        return x.permute(0, 2, 1, 3)
    if layout == "BSND":
        check_heads(x.size(2), num_heads, what)
        return x.permute(0, 2, 1, 3)
    check_heads(x.size(1), num_heads, what)
    return x


def check_heads(actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise OpInputError(
            f"{what} has {actual} heads on its N axis but the head-count argument says {expected}"
        )


def packed_to_padded(x: Tensor, lens: list[int], layout: str, num_heads: int, what: str) -> Tensor:
    """A TND ([T, N, D]) or NTD ([N, T, D]) tensor -> [B, N, max(lens), D] (one gather)."""
    if layout == "NTD":
        x = x.transpose(0, 1)
    check_heads(x.size(1), num_heads, what)
    if lens and min(lens) == max(lens) and x.size(0) == lens[0] * len(lens):
        # Equal lengths (e.g. a pure decode step): a view, no gather.
        return x.view(len(lens), lens[0], *x.shape[1:]).transpose(1, 2)
    idx, _ = packed_index(lens, x.device)
    if x.size(0) == 0:
        return x.new_zeros((len(lens), x.size(1), idx.size(1), x.size(2)))
    return x[idx.clamp_(max=x.size(0) - 1)].permute(0, 2, 1, 3)


def packed_index(lens: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Row index [B, max_len] into the packed tensor and the valid mask [B, max_len]."""
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    starts = torch.cumsum(lens_t, 0) - lens_t
    width = max(lens) if lens else 0
    pos = torch.arange(width, device=device).view(1, -1)
    return starts.view(-1, 1) + pos, pos < lens_t.view(-1, 1)


def padded_to_packed(x: Tensor, lens: list[int]) -> Tensor:
    """[B, N, S, ...] -> [T, N, ...] keeping only the first lens[b] rows of each request."""
    if lens and min(lens) == max(lens) == x.size(2):
        return x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])
    _, valid = packed_index(lens, x.device)
    return x.transpose(1, 2)[valid]


# Gathers larger than this many bytes allocate fresh memory instead of a reused workspace.
_WORKSPACE_MAX_BYTES = 1 << 30
_WORKSPACE: dict[tuple[str, torch.dtype, torch.device, bool], Tensor] = {}


def _gather_blocks(cache: Tensor, ids: Tensor, role: str) -> Tensor:
    """``cache[ids]`` ([B, nb, ...]) into a reused per-role buffer.

    NOTE: a fresh multi-MB allocation per call costs more in page faults than the copy itself
    (several times over for batch 64 x 4k); reusing one buffer per role (key, value, key_rope)
    avoids that. The result is only valid until the next gather of the same role, which is
    the same operator call.
    """
    flat = ids.reshape(-1)
    shape = (*ids.shape, *cache.shape[1:])
    numel = flat.numel() * cache[0].numel()
    too_big = numel * cache.element_size() > _WORKSPACE_MAX_BYTES
    if too_big or not cache.is_contiguous() or (cache.requires_grad and torch.is_grad_enabled()):
        return cache[ids]
    # Tensors made under inference_mode cannot be written outside it: one buffer per mode.
    key = (role, cache.dtype, cache.device, torch.is_inference_mode_enabled())
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        _WORKSPACE[key] = buf
    out = buf[:numel].view(flat.numel(), *cache.shape[1:])
    torch.index_select(cache, 0, flat, out=out)
    return out.view(shape)


def release_workspace() -> None:
    """Free the gather buffers (they are re-created on the next paged call)."""
    _WORKSPACE.clear()


def gather_paged(
    cache: Tensor,
    block_table: Tensor,
    kv_lens: list[int],
    num_kv_heads: int,
    what: str,
    *,
    workspace: str | None = None,
) -> Tensor:
    """Gather each request's blocks once -> [B, KVN, max(kv_lens), D].

    ``what`` names the tensor in errors; the result lives in the reused buffer of
    ``workspace`` (default ``what``) until the next gather into it.

    Cache forms by rank (npu_ops.md §1.7):
      3-D [num_blocks, block_size, KVN*D]           token t: [blk, t % bs, n*D:(n+1)*D]
      4-D [num_blocks, KVN, block_size, D]          token t: [blk, n, t % bs, :]
      5-D [num_blocks, KVN, D // C0, block_size, C0] (NZ shape, ND memory): [blk, n, d // C0,
          t % bs, d % C0]
    """
    max_len = max(kv_lens) if kv_lens else 0
    block_size = cache.size(1) if cache.dim() == 3 else cache.size(-2)
    num_used = -(-max_len // block_size) if block_size else 0
    # index_select takes the int32 table as it is: no int64 copy.
    ids = _needed_block_ids(block_table[:, :num_used], kv_lens, block_size, cache.size(0))
    b = ids.size(0)
    if cache.dim() == 3:
        if cache.size(2) % num_kv_heads:
            raise OpInputError(
                f"{what} cache hidden size {cache.size(2)} is not divisible by "
                f"num_key_value_heads={num_kv_heads}"
            )
        g = _gather_blocks(cache, ids, workspace or what)  # [B, nb, bs, KVN*D]
        g = g.view(b, num_used * block_size, num_kv_heads, cache.size(2) // num_kv_heads)
        g = g[:, :max_len]
        return g.permute(0, 2, 1, 3)
    check_heads(cache.size(1), num_kv_heads, f"{what} cache")
    if cache.dim() == 4:
        g = _gather_blocks(cache, ids, workspace or what)  # [B, nb, KVN, bs, D]
        g = g.permute(0, 2, 1, 3, 4).reshape(b, num_kv_heads, num_used * block_size, cache.size(3))
        return g[:, :, :max_len]
    if cache.dim() == 5:
        g = _gather_blocks(cache, ids, workspace or what)  # [B, nb, KVN, D/C0, bs, C0]
        g = g.permute(0, 2, 1, 4, 3, 5)  # [B, KVN, nb, bs, D/C0, C0]
        g = g.reshape(b, num_kv_heads, num_used * block_size, cache.size(2) * cache.size(4))
        return g[:, :, :max_len]
    raise OpInputError(
        f"paged {what} must be 3-D [num_blocks, block_size, H], 4-D [num_blocks, N, "
        f"block_size, D] or 5-D NZ [num_blocks, N, D/C0, block_size, C0]; got {describe(cache)}"
    )


def _needed_block_ids(ids: Tensor, kv_lens: list[int], block_size: int, num_blocks: int) -> Tensor:
    """The table's first columns, with entries a request does not need replaced by block 0.

    Only the blocks holding a request's first kv_lens[b] tokens are read (npu_ops.md §1.7: the
    device does not look at the rest, which may hold padding such as -1); gathering the batch's
    widest span reads the others too, so they are pointed at a real block. A needed entry
    outside the cache is an operator input error, as in the compiled decode kernel.
    """
    if ids.numel() == 0:
        return ids
    need_list = [-(-n // block_size) for n in kv_lens]
    if min(need_list) == ids.size(1):
        # Every request needs every column (equal lengths, a decode batch): one range check.
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo >= 0 and hi < num_blocks:
            return ids
    need = torch.tensor(need_list, device=ids.device)
    used = torch.arange(ids.size(1), device=ids.device) < need.view(-1, 1)
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise BlockIdError(
            f"block_table row {row} names a block outside the cache's {num_blocks} blocks "
            "within its first kv length tokens"
        )
    if bool(used.all()):
        return ids
    return torch.where(used, ids, torch.zeros((), dtype=ids.dtype, device=ids.device))


def paged_block_size(cache: Tensor) -> int:
    """The block_size axis of a 3-D, 4-D or 5-D paged cache."""
    return cache.size(1) if cache.dim() == 3 else cache.size(-2)


def format_output(out: Tensor, layout: Layout, q_lens: list[int]) -> Tensor:
    """[B, N, S, Dv] -> the output layout of ``input_layout``, contiguous.

    The device returns a freshly allocated tensor, and model code relies on it (a source
    kernel's ``attn_output.view(*input_shape, -1)`` after the call): a view of the padded
    result (one request's TND rows, a decode BSH) would make that ``view`` raise.
    """
    kind = layout.output
    if kind == "BNSD":
        return out.contiguous()
    if kind == "BSND":
        return out.permute(0, 2, 1, 3).contiguous()
    if kind == "BSH":
        b, n, s, d = out.shape
        return out.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if kind == "NBSD":
        return out.permute(1, 0, 2, 3).contiguous()
    packed = padded_to_packed(out, q_lens)  # [T, N, Dv]
    if kind == "NTD":
        return packed.transpose(0, 1).contiguous()
    return packed.contiguous()


def format_lse(lse: Tensor, layout: Layout, q_lens: list[int]) -> Tensor:
    """[B, N, S] -> (B, N, S, 1), or (T, N, 1) for packed query layouts (npu_ops.md §1.9)."""
    if layout.is_packed:
        return padded_to_packed(lse.unsqueeze(-1), q_lens).contiguous()
    return lse.unsqueeze(-1).contiguous()
