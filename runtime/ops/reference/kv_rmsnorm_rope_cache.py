"""torch_npu.npu_kv_rmsnorm_rope_cache: MLA latent RMSNorm + rope, written into the KV caches.

``kv`` [B, 1, S, Dc + 64] splits into the latent ``c`` (first Dc channels, RMSNorm with
``gamma``) and the rope part (last 64 channels). The rope input is interleaved and the output
rotate-half ("de-interleaved") order, so queries must use the same convention:

    x = kv[..., Dc:];  a = cat(x[0::2], x[1::2]);  b = cat(-x[1::2], x[0::2])
    k_rope = a * cos + b * sin

Results go to ``k_cache`` (rope) and ``ckv_cache`` (latent) in place; both caches are returned
as the same tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import OpInputError, describe, reject_if_used, strict_keywords
from .graph_ops import compiling, register
from .rope import interleaved_rope

OP = "npu_kv_rmsnorm_rope_cache"
ROPE_DIM = 64
CACHE_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")


def nz_c0(dtype: torch.dtype) -> int:
    """NZ inner block width: 32 for int8, 16 otherwise.

    unconfirmed: C0 for fp32 caches (only fp16/bf16 = 16 and int8 = 32 are documented for this
    operator); the reference uses 16, matching the FA 5-D view ``[nb, N, D // 16, bs, 16]``.
    """
    return 32 if dtype == torch.int8 else 16


@strict_keywords(OP, {"cache_mod": "the keyword is `cache_mode`"})
def npu_kv_rmsnorm_rope_cache(
    kv: Tensor,
    gamma: Tensor,
    cos: Tensor,
    sin: Tensor,
    index: Tensor,
    k_cache: Tensor,
    ckv_cache: Tensor,
    *,
    k_rope_scale: Tensor | None = None,
    c_kv_scale: Tensor | None = None,
    k_rope_offset: Tensor | None = None,
    c_kv_offset: Tensor | None = None,
    v: Tensor | None = None,
    epsilon: float = 1e-5,
    cache_mode: str = "Norm",
    is_output_kv: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RMSNorm + rope of the MLA latent, written to the caches at ``index``.

    Returns:
        (k_cache, ckv_cache, k_rope [B, 1, S, 64], c_kv [B, 1, S, Dc]). The caches are the
        tensors passed in. ``k_rope``/``c_kv`` hold results only with ``is_output_kv=True`` in a
        PA mode; otherwise the device leaves them unwritten and the reference fills them with
        NaN so an accidental read shows up (unconfirmed: their device content).
    """
    reject_if_used(OP, v=v, k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset)
    write = _KV_RMSNORM_ROPE_CACHE_OP if compiling() else _write_caches
    k_rope, c = write(
        kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale, c_kv_scale, epsilon,
        cache_mode, is_output_kv,
    )  # fmt: skip
    return k_cache, ckv_cache, k_rope, c


def _write_caches(
    kv: Tensor,
    gamma: Tensor,
    cos: Tensor,
    sin: Tensor,
    index: Tensor,
    k_cache: Tensor,
    ckv_cache: Tensor,
    k_rope_scale: Tensor | None,
    c_kv_scale: Tensor | None,
    epsilon: float,
    cache_mode: str,
    is_output_kv: bool,
) -> tuple[Tensor, Tensor]:
    """The operator's checks and cache writes (the registered operator's body); returns the
    (k_rope, c_kv) outputs, fresh tensors."""
    if cache_mode not in CACHE_MODES:
        raise OpInputError(
            f"{OP}: cache_mode must be one of {list(CACHE_MODES)}, got {cache_mode!r}"
        )
    c, k_rope = _norm_and_rope(kv, gamma, cos, sin, epsilon)
    quant = k_rope_scale is not None or c_kv_scale is not None
    if quant and cache_mode == "Norm":
        raise OpInputError(f"{OP}: quantised caches (k_rope_scale/c_kv_scale) need a PA cache_mode")
    k_val = _quantize(k_rope, k_rope_scale, k_cache.dtype, "k_rope_scale")
    c_val = _quantize(c, c_kv_scale, ckv_cache.dtype, "c_kv_scale")
    if cache_mode == "Norm":
        _write_norm(k_cache, k_val, index)
        _write_norm(ckv_cache, c_val, index)
    else:
        slots = _slots(cache_mode, index, kv.size(0), kv.size(2), k_cache)
        nz = cache_mode.endswith("NZ")
        _write_paged(k_cache, k_val, slots, nz, "k_cache")
        _write_paged(ckv_cache, c_val, slots, nz, "ckv_cache")
    if is_output_kv and cache_mode != "Norm":
        return k_rope, c
    return torch.full_like(k_rope, float("nan")), torch.full_like(c, float("nan"))


def _write_caches_fake(
    kv: Tensor,
    gamma: Tensor,
    cos: Tensor,
    sin: Tensor,
    index: Tensor,
    k_cache: Tensor,
    ckv_cache: Tensor,
    k_rope_scale: Tensor | None,
    c_kv_scale: Tensor | None,
    epsilon: float,
    cache_mode: str,
    is_output_kv: bool,
) -> tuple[Tensor, Tensor]:
    # k_rope [B, 1, S, 64] and c_kv [B, 1, S, Dc] in kv's dtype (npu_ops.md §3)
    b, _, s, _ = kv.shape
    return kv.new_empty(b, 1, s, ROPE_DIM), kv.new_empty(b, 1, s, gamma.numel())


#: kvskill::kv_rmsnorm_rope_cache, which writes k_cache and ckv_cache
_KV_RMSNORM_ROPE_CACHE_OP = register(
    "kv_rmsnorm_rope_cache",
    _write_caches,
    _write_caches_fake,
    mutates_args=("k_cache", "ckv_cache"),
)


def _norm_and_rope(
    kv: Tensor, gamma: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    if kv.dim() != 4 or kv.size(1) != 1:
        raise OpInputError(f"{OP}: kv must be 4-D [B, 1, S, Dc + {ROPE_DIM}], got {describe(kv)}")
    if gamma.dim() != 1 or kv.size(-1) != gamma.numel() + ROPE_DIM:
        raise OpInputError(
            f"{OP}: kv last dim ({kv.size(-1)}) must equal gamma size ({gamma.numel()}) + "
            f"{ROPE_DIM}; gamma must be 1-D"
        )
    want = (kv.size(0), 1, kv.size(2), ROPE_DIM)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 4 or t.size(-1) != ROPE_DIM or torch.broadcast_shapes(t.shape, want) != want:
            raise OpInputError(
                f"{OP}: {name} must be 4-D broadcastable to {want}, got {describe(t)}"
            )
    dc = gamma.numel()
    x = kv.float()
    latent = x[..., :dc]
    c = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
    k_rope = interleaved_rope(x[..., dc:], cos, sin)
    return c.to(kv.dtype), k_rope.to(kv.dtype)


def _quantize(x: Tensor, scale: Tensor | None, dtype: torch.dtype, name: str) -> Tensor:
    """int8 cache: ``round(x * scale).clamp(-128, 127)`` (the scale multiplies)."""
    if scale is None:
        return x
    if dtype != torch.int8:
        raise OpInputError(f"{OP}: `{name}` needs an int8 cache, the cache is {dtype}")
    if scale.numel() != x.size(-1):
        raise OpInputError(f"{OP}: `{name}` must have {x.size(-1)} entries, got {describe(scale)}")
    return torch.round(x.float() * scale.float().view(-1)).clamp_(-128, 127).to(torch.int8)


def _write_norm(cache: Tensor, val: Tensor, index: Tensor) -> None:
    """``cache[b, 0, index[b, s]] = val[b, 0, s]``; negative index = skip."""
    b, _, s, d = val.shape
    if index.shape != (b, s):
        raise OpInputError(
            f"{OP}: cache_mode 'Norm' needs index [B, S] = {(b, s)}, got {describe(index)}"
        )
    if cache.dim() != 4 or cache.size(0) != b or cache.size(-1) != d:
        raise OpInputError(
            f"{OP}: cache_mode 'Norm' needs caches [B, 1, C, {d}], got {describe(cache)}"
        )
    idx = index.long()
    keep = idx >= 0
    rows = torch.arange(b, device=idx.device).view(-1, 1).expand(b, s)
    cache[rows[keep], 0, idx[keep]] = val[:, 0][keep].to(cache.dtype)


def _slots(mode: str, index: Tensor, b: int, s: int, k_cache: Tensor) -> Tensor:
    """Global slot per token, [B * S]; -1 = skip."""
    bs = k_cache.size(1)
    if mode in ("PA", "PA_BNSD", "PA_NZ"):
        if index.numel() != b * s:
            raise OpInputError(
                f"{OP}: cache_mode {mode!r} needs index [B*S] = [{b * s}] global slots, got "
                f"{describe(index)}"
            )
        return index.reshape(-1).long()
    pages = -(-s // bs)
    if index.numel() != b * pages:
        raise OpInputError(
            f"{OP}: cache_mode {mode!r} needs index [B*ceil(S/block_size)] = [{b * pages}] page "
            f"offsets, got {describe(index)}"
        )
    starts = index.reshape(b, pages).long()
    pos = torch.arange(s, device=starts.device)
    page_start = starts[:, pos // bs]  # [B, S]
    slots = (page_start // bs) * bs + (pos % bs).view(1, -1)
    return torch.where(page_start >= 0, slots, torch.full_like(slots, -1)).reshape(-1)


def _write_paged(cache: Tensor, val: Tensor, slots: Tensor, nz: bool, name: str) -> None:
    """Paged write of val [B, 1, S, D] at slots [B*S] into cache [nb, bs, 1, D].

    ND: slot p -> cache[p // bs, p % bs, 0, :]. NZ (same declared shape, NZ memory): element
    (page, t, d) sits at flat offset page*D*bs + (d // C0)*bs*C0 + t*C0 + d % C0, i.e. the
    storage is [nb, D // C0, bs, C0].
    """
    d = val.size(-1)
    if cache.dim() != 4 or cache.size(2) != 1 or cache.size(3) != d:
        raise OpInputError(
            f"{OP}: {name} must be [num_blocks, block_size, 1, {d}], got {describe(cache)}"
        )
    nb, bs = cache.size(0), cache.size(1)
    rows = val.reshape(-1, d)
    keep = slots >= 0
    p = slots[keep]
    if p.numel() and int(p.max()) >= nb * bs:
        raise OpInputError(f"{OP}: slot {int(p.max())} is beyond {name} ({nb} blocks x {bs})")
    src = rows[keep].to(cache.dtype)
    if not nz:
        cache.view(nb * bs, d)[p] = src
        return
    c0 = nz_c0(cache.dtype)
    if d % c0 or not cache.is_contiguous():
        raise OpInputError(
            f"{OP}: NZ {name} needs a contiguous cache with D % {c0} == 0, got {describe(cache)}"
        )
    storage = cache.view(nb, d // c0, bs, c0)
    storage[p // bs, :, p % bs, :] = src.view(-1, d // c0, c0)
