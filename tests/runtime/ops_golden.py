"""Naive attention and paged-cache builders for the operator golden tests.

Written independently of the operator code: plain loops over requests, heads and query rows,
float64 math, admission rules spelled out per sparse mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

INT_MAX = 2147483647
CAUSAL_TILE = torch.ones(2048, 2048, dtype=torch.bool).triu(diagonal=1)

Rule = Callable[[int, int, int, int], bool]  # (i, j, S1, S2) -> key j admitted for row i


def rule_for(mode: int, pre: int = INT_MAX, nxt: int = INT_MAX) -> Rule:
    """The admission rule of one sparse mode, as the operator documentation states it."""
    if mode == 0:
        return lambda i, j, s1, s2: True
    if mode == 2:
        return lambda i, j, s1, s2: j <= i
    if mode == 3:
        return lambda i, j, s1, s2: j <= i + s2 - s1
    if mode == 4:
        return lambda i, j, s1, s2: s2 - s1 + i - pre <= j <= s2 - s1 + i + nxt
    raise ValueError(mode)


def naive_request(
    q: torch.Tensor,  # [S1, N, D]
    k: torch.Tensor,  # [S2, KVN, D]
    v: torch.Tensor,  # [S2, KVN, Dv]
    scale: float,
    admit: Rule,
    sink: torch.Tensor | None = None,  # [N]
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request: out [S1, N, Dv] float64, lse [S1, N] float64."""
    s1, n, _ = q.shape
    s2, kvn, dv = v.shape
    group = n // kvn
    out = torch.zeros(s1, n, dv, dtype=torch.float64)
    lse = torch.full((s1, n), -math.inf, dtype=torch.float64)
    for h in range(n):
        kh = h // group
        for i in range(s1):
            keys = [j for j in range(s2) if admit(i, j, s1, s2)]
            logits = []
            for j in keys:
                dot = float(q[i, h].double() @ k[j, kh].double())
                if q_rope is not None:
                    dot += float(q_rope[i, h].double() @ k_rope[j, kh].double())
                logits.append(scale * dot)
            if sink is not None:
                logits.append(float(sink[h]))
            if not logits:
                continue
            m = max(logits)
            weights = [math.exp(x - m) for x in logits]
            total = sum(weights)
            for w, j in zip(weights, keys, strict=False):
                out[i, h] += (w / total) * v[j, kh].double()
            lse[i, h] = m + math.log(total)
    return out, lse


@dataclass
class PagedCase:
    """Per-request dense tensors plus the same KV scattered into a paged cache."""

    qs: list[torch.Tensor]  # [S1, N, D] per request
    ks: list[torch.Tensor]  # [S2, KVN, D]
    vs: list[torch.Tensor]  # [S2, KVN, Dv]
    key_cache: torch.Tensor  # [num_blocks, block_size, KVN, D]
    value_cache: torch.Tensor  # [num_blocks, block_size, KVN, Dv]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    block_size: int

    @property
    def query_tnd(self) -> torch.Tensor:
        return torch.cat(self.qs)

    @property
    def q_lens(self) -> list[int]:
        return [q.shape[0] for q in self.qs]

    @property
    def kv_lens(self) -> list[int]:
        return [k.shape[0] for k in self.ks]

    @property
    def cu_q(self) -> list[int]:
        return list(torch.tensor(self.q_lens).cumsum(0).tolist())


def make_paged_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    head_dim_v: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    extra_table_columns: int = 1,
) -> PagedCase:
    """Random requests; each request's blocks are a random, non-sequential set of block ids.

    Unused cache rows (other requests' blocks, the tail of the last block, block 0) hold
    random garbage, so any read outside a request's own tokens changes the result.
    """
    gen = torch.Generator().manual_seed(seed)
    dv = head_dim_v or head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    qs = [rand(s1, num_heads, head_dim) for s1 in q_lens]
    ks = [rand(s2, num_kv_heads, head_dim) for s2 in kv_lens]
    vs = [rand(s2, num_kv_heads, dv) for s2 in kv_lens]
    blocks_per_req = [-(-s2 // block_size) for s2 in kv_lens]
    num_blocks = 1 + sum(blocks_per_req) + 2
    key_cache = rand(num_blocks, block_size, num_kv_heads, head_dim) * 50
    value_cache = rand(num_blocks, block_size, num_kv_heads, dv) * 50
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks_per_req) + extra_table_columns
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for t in range(k.shape[0]):
            if t % block_size == 0:
                table[b, t // block_size] = ids.pop()
            blk = int(table[b, t // block_size])
            key_cache[blk, t % block_size] = k[t]
            value_cache[blk, t % block_size] = v[t]
    return PagedCase(qs, ks, vs, key_cache, value_cache, table, block_size)


def naive_batch(
    case: PagedCase,
    scale: float,
    admit: Rule,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [T, N, Dv] output and [T, N] lse of every request."""
    outs, lses = [], []
    for q, k, v in zip(case.qs, case.ks, case.vs, strict=True):
        o, lse = naive_request(q, k, v, scale, admit, sink)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 1.6e-2, "rtol": 1.6e-2}


def pack(parts: list[torch.Tensor], layout: str, pad_to: int) -> torch.Tensor:
    """Per-request [S, N, D] tensors -> one tensor in ``layout``; padding rows hold garbage."""
    if layout in ("TND", "NTD"):
        packed = torch.cat(parts)
        return packed if layout == "TND" else packed.transpose(0, 1).contiguous()
    n, d = parts[0].shape[1:]
    padded = torch.full((len(parts), pad_to, n, d), 1e4, dtype=parts[0].dtype)
    for b, p in enumerate(parts):
        padded[b, : p.shape[0]] = p
    if layout == "BSND":
        return padded
    if layout == "BSH":
        return padded.reshape(len(parts), pad_to, n * d)
    return padded.transpose(1, 2).contiguous()  # BNSD


def unpack(out: torch.Tensor, layout: str, lens: list[int], n: int) -> list[torch.Tensor]:
    """Output in ``layout`` -> per-request [S, N, Dv]."""
    if layout in ("TND", "NTD"):
        flat = out if layout == "TND" else out.transpose(0, 1)
        return list(flat.split(lens))
    if layout == "BSH":
        out = out.view(out.shape[0], out.shape[1], n, -1)
    elif layout == "BNSD":
        out = out.transpose(1, 2)
    elif layout == "NBSD":
        out = out.permute(1, 2, 0, 3)
    return [out[b, :s] for b, s in enumerate(lens)]


def paged_fia_v1(
    case: PagedCase,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    mode: int,
    pre: int = INT_MAX,
    nxt: int = INT_MAX,
    lse: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA v1 as converted models call it: TND query over the case's paged 3-D caches.

    Sparse modes 2-4 get the compressed causal tile unless ``mask`` is given.
    """
    from kvskill.runtime.ops import reference as npu

    nb, bs = case.key_cache.shape[:2]
    if mask is None and mode in (2, 3, 4):
        mask = CAUSAL_TILE
    return npu.npu_fused_infer_attention_score(
        case.query_tnd,
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        input_layout="TND",
        scale=scale,
        atten_mask=mask,
        sparse_mode=mode,
        pre_tokens=pre,
        next_tokens=nxt,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_lengths=case.cu_q,
        actual_seq_lengths_kv=case.kv_lens,
        softmax_lse_flag=lse,
    )


def spy_on_decode_kernel(monkeypatch) -> list[bool]:
    """Record, per paged fused-attention call, whether the compiled decode kernel answered it
    (a None return leaves the call to the PyTorch path)."""
    from kvskill.runtime.ops.reference import fused_attention

    answered: list[bool] = []
    original = fused_attention.paged_decode

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        answered.append(out is not None)
        return out

    monkeypatch.setattr(fused_attention, "paged_decode", spy)
    return answered


def make_mla_paged_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_heads: int,
    block_size: int,
    seed: int,
    latent_dim: int = 128,
    rope_dim: int = 64,
) -> tuple[PagedCase, PagedCase]:
    """(latent, rope): absorbed MLA's latent cache and its rope-key cache, one kv head each,
    the rope keys written at the latent's slots (one block table serves both)."""
    latent = make_paged_case(
        q_lens,
        kv_lens,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=latent_dim,
        block_size=block_size,
        seed=seed,
    )
    rope = make_paged_case(
        q_lens,
        kv_lens,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=rope_dim,
        block_size=block_size,
        seed=seed + 1,
    )
    rope.block_table.copy_(latent.block_table)
    for b, s2 in enumerate(kv_lens):
        for t in range(s2):
            blk = int(latent.block_table[b, t // block_size])
            rope.key_cache[blk, t % block_size] = rope.ks[b][t]
    return latent, rope
