"""custom.compressor: DeepSeek-V4's pooling of every ``cmp_ratio`` tokens into one cache entry.

For request b, the tokens of ``x`` sit at positions start_pos[b] .. start_pos[b] + n - 1 (n =
``seqused[b]``, else its length). Each token p gets

    kv[p]    = x[p] @ wkv^T                            [coff * D]
    score[p] = x[p] @ wgate^T + ape[p % cmp_ratio]     [coff * D]

and every window w (positions w*r .. w*r + r - 1, r = cmp_ratio) whose last position falls in
this call emits one entry, per feature d:

    coff 1 (C128A):  C[w] = sum over the r slots of softmax(score)_slot * kv_slot
    coff 2 (C4A/C4Li, overlapping): the 2r slots are window w-1's first half of features
                     (kv[p][:D], score[p][:D]) and window w's second half (kv[p][D:], ...);
                     window 0 has only its own r slots
    out[w]   = rope(norm_weight * C / sqrt(mean(C^2) + norm_eps))

with RoPE on the trailing ``rope_head_dim`` features (rotary_mode 2 interleaved pairs, 1 halves)
at the cos/sin row of the output row (compressor doc:13-43). Positions before start_pos (the
unfinished window, and for coff 2 the window before it) come from ``state_cache``: token p's
``[kv, score]`` (score with ape added, doc:40) at row p % block_size of block
``state_block_table[b][p // block_size]``; every new token's state is written there unless that
entry is 0 ("无需进行更新state_cache操作", doc:81).

Output (doc:99): x [B, S, H] -> [B, ceil(S/r), D], request b's entries first, zero after them;
x [T, H] (with ``cu_seqlens``) -> [min(T, T//r + B), D], every request's entries back to back,
zero after.

NOTE, unconfirmed on device: the doc writes C4A's pairing as score^a of window i with
score^b of window i+1 (doc:20); read here as transformers' DeepSeek-V4 and the overlap state
of the doc's example do (entry w = a-half of window w-1 + b-half of window w, ``a`` the first D
rows of ``wkv``); the RoPE slice is the trailing one, as the framework's quantized path rotates
it (``modules/compressor.py:381``); pad rows are zero; reading a state position whose block
entry is 0 is refused (the doc makes 0 the "no state" marker).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import describe, strict_keywords
from ..npu_limits import NPU_ONLY
from ..npu_profile import current_profile
from .limits import check_cmp_ratio, check_half, check_int32, cu_seqlens_lengths, fail

OP = "compressor"
#: doc:139-144: (head dim D, coff, cmp_ratio) of the three supported cases
CASES = {(512, 2, 4): "C4A", (128, 2, 4): "C4Li", (512, 1, 128): "C128A"}
#: doc:75 "rope_head_dim ... 目前仅支持64"
ROPE_HEAD_DIM = 64
#: doc:140 "支持H为1K~10K，512对齐"
HIDDEN_RANGE, HIDDEN_MULTIPLE = (1024, 10240), 512


@strict_keywords(OP, {"block_table": "the state's table is `state_block_table`"})
def compressor(
    x: Tensor,
    wkv: Tensor,
    wgate: Tensor,
    state_cache: Tensor,
    ape: Tensor,
    norm_weight: Tensor,
    rope_sin: Tensor,
    rope_cos: Tensor,
    rope_head_dim: int,
    cmp_ratio: int,
    *,
    state_block_table: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    seqused: Tensor | None = None,
    start_pos: Tensor | None = None,
    coff: int = 1,
    norm_eps: float = 1e-6,
    rotary_mode: int = 1,
    cache_mode: int = 1,
) -> Tensor:
    """The entries completed by these tokens; updates ``state_cache`` in place."""
    dim = _check_arguments(
        x, wkv, wgate, state_cache, ape, norm_weight, rope_head_dim, cmp_ratio,
        state_block_table, coff, rotary_mode, cache_mode,
    )  # fmt: skip
    lengths = _lengths(x, cu_seqlens)
    batch = len(lengths)
    used = _used(seqused, lengths)
    starts = _starts(start_pos, batch)
    _check_table(state_block_table, state_cache.size(1), lengths, starts, batch)
    rows_out = out_shape(x, cmp_ratio, dim, batch)
    _check_rope(rope_sin, rope_cos, rows_out, rope_head_dim)
    out = x.new_zeros(rows_out)
    packed = x.dim() == 2
    tokens = x.split(lengths) if packed else list(x.unbind(0))
    sin = rope_sin if packed else list(rope_sin.unbind(0))
    cos = rope_cos if packed else list(rope_cos.unbind(0))
    row = 0
    for b in range(batch):
        state = _State(state_cache, state_block_table[b], coff * dim)
        entries = _request(tokens[b][: used[b]].float(), starts[b], wkv, wgate, ape, state,
                           cmp_ratio, coff, dim)  # fmt: skip
        n = entries.size(0)
        at = slice(row, row + n) if packed else slice(0, n)
        rope_sin_b, rope_cos_b = (sin, cos) if packed else (sin[b], cos[b])
        normed = _rms_norm(entries, norm_weight.float(), norm_eps)
        rotated = _rope(normed, rope_cos_b[at].float(), rope_sin_b[at].float(), rotary_mode)
        (out[at] if packed else out[b, at]).copy_(rotated)
        row += n
    return out


def out_shape(x: Tensor, cmp_ratio: int, dim: int, batch: int) -> tuple[int, ...]:
    """doc:99: [B, ceil(S/r), D] or [min(T, T//r + B), D]."""
    if x.dim() == 3:
        return (x.size(0), -(-x.size(1) // cmp_ratio), dim)
    t = x.size(0)
    return (min(t, t // cmp_ratio + batch), dim)


def compressor_fake(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos,
                    rope_head_dim, cmp_ratio, *, cu_seqlens=None, coff=1, **_) -> Tensor:  # fmt: skip
    batch = cu_seqlens.size(0) - 1 if cu_seqlens is not None else x.size(0)
    return x.new_empty(out_shape(x, cmp_ratio, wkv.size(0) // coff, batch))


class _State:
    """One request's view of the paged fp32 state: token position -> [kv | score] row."""

    def __init__(self, cache: Tensor, table: Tensor, width: int) -> None:
        self.cache, self.table, self.width = cache, table, width
        self.block_size = cache.size(1)

    def _block(self, pos: int) -> int:
        block = int(self.table[pos // self.block_size])
        if not 0 <= block < self.cache.size(0):
            fail(OP, f"state_block_table names block {block}; state_cache has {self.cache.size(0)}")
        return block

    def read(self, first: int, end: int) -> tuple[Tensor, Tensor]:
        rows = []
        for p in range(first, end):
            block = self._block(p)
            if block == 0:
                fail(OP, f"state position {p} is needed but its state_block_table entry is 0")
            rows.append(self.cache[block, p % self.block_size])
        if not rows:
            empty = self.cache.new_zeros((0, self.width))
            return empty, empty
        stacked = torch.stack(rows)
        return stacked[:, : self.width], stacked[:, self.width :]

    def write(self, start: int, kv: Tensor, score: Tensor) -> None:
        for i in range(kv.size(0)):
            block = self._block(start + i)
            if block != 0:
                self.cache[block, (start + i) % self.block_size] = torch.cat([kv[i], score[i]])


def _request(x, start, wkv, wgate, ape, state, ratio, coff, dim) -> Tensor:  # fmt: skip
    """Pooled (pre-norm) entries of the windows completed by one request's tokens: [E, D]."""
    n = x.size(0)
    positions = torch.arange(start, start + n)
    kv = x @ wkv.float().t()
    score = x @ wgate.float().t() + ape.float()[positions % ratio]
    first = max(0, (start // ratio) * ratio - (ratio if coff == 2 else 0))
    old_kv, old_score = state.read(first, start)
    state.write(start, kv, score)
    kv_all, score_all = torch.cat([old_kv, kv]), torch.cat([old_score, score])
    entries = []
    for w in range(start // ratio, (start + n) // ratio):
        cur = slice(w * ratio - first, (w + 1) * ratio - first)
        if coff == 1:
            slots_kv, slots_score = kv_all[cur], score_all[cur]
        else:
            slots_kv, slots_score = kv_all[cur, dim:], score_all[cur, dim:]
            if w > 0:
                prev = slice((w - 1) * ratio - first, w * ratio - first)
                slots_kv = torch.cat([kv_all[prev, :dim], slots_kv])
                slots_score = torch.cat([score_all[prev, :dim], slots_score])
        entries.append((slots_score.softmax(dim=0) * slots_kv).sum(dim=0))
    return torch.stack(entries) if entries else x.new_zeros((0, dim))


def _rms_norm(c: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * c * torch.rsqrt(c.pow(2).mean(dim=-1, keepdim=True) + eps)


def _rope(c: Tensor, cos: Tensor, sin: Tensor, rotary_mode: int) -> Tensor:
    """Rotate the trailing cos.size(-1) features: 2 = interleaved pairs, 1 = halves."""
    width = cos.size(-1)
    head, tail = c[:, :-width], c[:, -width:]
    if rotary_mode == 2:
        pairs = tail.view(-1, width // 2, 2)
        turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).view(-1, width)
    else:
        turned = torch.cat([-tail[:, width // 2 :], tail[:, : width // 2]], dim=-1)
    return torch.cat([head, tail * cos + turned * sin], dim=-1)


def _check_arguments(
    x, wkv, wgate, state_cache, ape, norm_weight, rope_head_dim, cmp_ratio, table, coff,
    rotary_mode, cache_mode,
) -> int:  # fmt: skip
    """Every documented limit of the call's static arguments; returns the head dim D."""
    check_cmp_ratio(OP, cmp_ratio)
    if coff not in (1, 2):
        fail(OP, f"coff must be 1 (no overlap) or 2 (overlapping windows), got {coff}")
    if rotary_mode not in (1, 2):
        fail(OP, f"rotary_mode must be 1 (half) or 2 (interleave), got {rotary_mode}")
    if cache_mode != 1:
        # doc:95 "目前暂不支持输入2"
        fail(OP, f"cache_mode takes only 1 (contiguous state buffer), got {cache_mode}")
    if x.dim() not in (2, 3):
        fail(OP, f"x must be [B, S, H] or [T, H], got {describe(x)}")
    if x.numel() == 0:
        fail(OP, "x must not be empty")
    hidden = x.size(-1)
    for name, w in (("wkv", wkv), ("wgate", wgate)):
        if w.dim() != 2 or w.size(1) != hidden or w.size(0) % coff:
            fail(OP, f"`{name}` must be [coff * D, H] with H={hidden}, got {describe(w)}")
    if wgate.shape != wkv.shape:
        fail(OP, f"wkv and wgate must have one shape, got {describe(wkv)}, {describe(wgate)}")
    dim = wkv.size(0) // coff
    # doc:141-144: the ratio fixes the overlap whatever D is
    if (coff, cmp_ratio) not in {(c, r) for _, c, r in CASES}:
        fail(OP, f"cmp_ratio {cmp_ratio} takes coff {2 if cmp_ratio == 4 else 1}, got {coff}")
    check_half(OP, x=x, wkv=wkv, wgate=wgate)
    for name, t, shape in (
        ("state_cache", state_cache, None),
        ("ape", ape, (cmp_ratio, coff * dim)),
        ("norm_weight", norm_weight, (dim,)),
    ):
        if t.dtype != torch.float32:
            fail(OP, f"`{name}` must be float32, got {describe(t)}")
        if shape is not None and tuple(t.shape) != shape:
            fail(OP, f"`{name}` must be {list(shape)}, got {describe(t)}")
    if state_cache.dim() != 3 or state_cache.size(0) == 0 or state_cache.size(2) != 2 * coff * dim:
        fail(
            OP,
            f"state_cache must be [block_num > 0, block_size, {2 * coff * dim}] (2 * coff * D), "
            f"got {describe(state_cache)}",
        )
    if rope_head_dim <= 0 or rope_head_dim % 2 or rope_head_dim > dim:
        fail(OP, f"rope_head_dim must be even and at most D={dim}, got {rope_head_dim}")
    if table is None:
        fail(OP, "state_block_table is required: the unfinished window's state lives there")
    check_int32(OP, "state_block_table", table, 2)
    if current_profile().dims:
        if (dim, coff, cmp_ratio) not in CASES:
            fail(OP, f"(D, coff, cmp_ratio) must be one of {list(CASES)}, got {(dim, coff, cmp_ratio)} ({NPU_ONLY})")  # fmt: skip
        if rope_head_dim != ROPE_HEAD_DIM:
            fail(OP, f"rope_head_dim must be {ROPE_HEAD_DIM}, got {rope_head_dim} ({NPU_ONLY})")
        low, high = HIDDEN_RANGE
        if not low <= hidden <= high or hidden % HIDDEN_MULTIPLE:
            fail(OP, f"H must be in [{low}, {high}] and a multiple of {HIDDEN_MULTIPLE}, got {hidden} ({NPU_ONLY})")  # fmt: skip
    return dim


def _lengths(x: Tensor, cu_seqlens: Tensor | None) -> list[int]:
    if x.dim() == 3:
        if cu_seqlens is not None:
            # doc:83 "当x的shape为[B,S,H]时，参数必须为空"
            fail(OP, "cu_seqlens must be None when x is [B, S, H]")
        return [x.size(1)] * x.size(0)
    if cu_seqlens is None:
        fail(OP, "x [T, H] needs cu_seqlens ([B + 1] prefix sums)")
    check_int32(OP, "cu_seqlens", cu_seqlens, 1)
    lengths = cu_seqlens_lengths(OP, "cu_seqlens", cu_seqlens)
    if sum(lengths) > x.size(0):
        fail(OP, f"cu_seqlens ends at {sum(lengths)} but x holds {x.size(0)} tokens")
    return lengths


def _used(seqused: Tensor | None, lengths: list[int]) -> list[int]:
    if seqused is None:
        return lengths
    check_int32(OP, "seqused", seqused, 1)
    used = [int(n) for n in seqused.tolist()]
    if len(used) != len(lengths):
        fail(OP, f"seqused holds {len(used)} values for {len(lengths)} requests")
    for b, (u, n) in enumerate(zip(used, lengths, strict=True)):
        if not 0 <= u <= n:
            # doc:85 "要求seqused[n] <= S，且不小于0"
            fail(OP, f"seqused[{b}]={u} must be in [0, {n}] (the request's tokens)")
    return used


def _starts(start_pos: Tensor | None, batch: int) -> list[int]:
    if start_pos is None:
        return [0] * batch
    check_int32(OP, "start_pos", start_pos, 1)
    starts = [int(n) for n in start_pos.tolist()]
    if len(starts) != batch or min(starts) < 0:
        fail(OP, f"start_pos must hold {batch} positions >= 0, got {starts}")
    return starts


def _check_table(table: Tensor, block_size: int, lengths, starts, batch: int) -> None:
    # doc:81: "[B, ceil(Smax/block_size)]", Smax = max(start_pos) + the longest request
    if table.size(0) != batch:
        fail(OP, f"state_block_table has {table.size(0)} rows for {batch} requests")
    need = max(-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True))
    if table.size(1) < need:
        fail(OP, f"state_block_table has {table.size(1)} columns, the longest request needs {need}")


def _check_rope(sin: Tensor, cos: Tensor, out: tuple[int, ...], rope_head_dim: int) -> None:
    want = (*out[:-1], rope_head_dim)
    for name, t in (("rope_sin", sin), ("rope_cos", cos)):
        if t.dtype != torch.float32 or tuple(t.shape) != want:
            # doc:71/73: float32, [B, ceil(S/r), rope_head_dim] or [min(T, T//r + B), ...]
            fail(OP, f"`{name}` must be float32 of shape {list(want)}, got {describe(t)}")
