"""Masked softmax attention over padded batches: the numerics shared by FA v1 and v2.

Everything here works on a padded, head-major view that the layout layer builds once per call:

    q      [B, N,  Sq,  D]    (query rows past q_lens[b] are padding)
    k      [B, KVN, Skv, D]   (key columns past kv_lens[b] are padding)
    v      [B, KVN, Skv, Dv]

Query head h reads kv head h // G with G = N / KVN (groups are contiguous). Masks are built per
request from index arithmetic, never as a dense T x T matrix across requests. Scores, softmax and
the weighted sum run in fp32; the caller casts the result to the query dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

# Score elements materialised at once; larger problems are split over query rows.
_SCORE_BUDGET = 1 << 25
# Mask elements built at once on the fused (SDPA) path.
_MASK_BUDGET = 1 << 27


@dataclass(frozen=True, slots=True)
class Admission:
    """Which key j a query row i of request b may use (npu_ops.md §1.5).

    Coordinates are local to the request: i in [0, S1), j in [0, S2) with S1 = q_lens[b] and
    S2 = kv_lens[b]. Padding rows/columns are never admitted.
    """

    #: 0..4; ignored when ``decode_branch`` is set
    sparse_mode: int = 0
    #: inclusive window bounds; only used by mode 0 with a mask and by mode 4
    pre_tokens: int = 2147483647
    next_tokens: int = 2147483647
    #: bool [B or 1, >=Sq, >=Skv], True = masked out; modes 0/1 only
    user_mask: Tensor | None = None
    #: the single-query (decode) kernel: only kv length and an optional per-request key mask
    decode_branch: bool = False
    #: bool [B, >=Skv], True = masked out; decode branch only
    key_mask: Tensor | None = None

    def for_requests(self, idx: Tensor, batch: int) -> Admission:
        """The rule for the requests ``idx`` of a ``batch``-request call (masks sliced)."""
        user_mask, key_mask = self.user_mask, self.key_mask
        if user_mask is not None and user_mask.size(0) == batch and batch > 1:
            user_mask = user_mask.index_select(0, idx)
        if key_mask is not None:
            key_mask = key_mask.index_select(0, idx)
        if user_mask is self.user_mask and key_mask is self.key_mask:
            return self
        return replace(self, user_mask=user_mask, key_mask=key_mask)

    def allowed(self, rows: range, num_keys: int, q_lens: Tensor, kv_lens: Tensor) -> Tensor:
        """Return bool [B, len(rows), num_keys], True where the key is used."""
        device = q_lens.device
        i = torch.arange(rows.start, rows.stop, device=device).view(1, -1, 1)
        j = torch.arange(num_keys, device=device).view(1, 1, -1)
        s1 = q_lens.view(-1, 1, 1)
        s2 = kv_lens.view(-1, 1, 1)
        ok = (i < s1) & (j < s2)
        if self.decode_branch:
            if self.key_mask is not None:
                ok = ok & ~self.key_mask[:, None, :num_keys]
            return ok
        mode = self.sparse_mode
        # Padding rows of a padded layout (i >= S1) are excluded above and come back as zeros.
        # unconfirmed: the device most likely zero-initialises them too.
        if mode in (0, 1) and self.user_mask is not None:
            ok = ok & ~_mask_window(self.user_mask, rows, num_keys)
        if mode == 0 and self.user_mask is not None:
            ok = ok & (j >= i - self.pre_tokens) & (j <= i + self.next_tokens)
        elif mode == 2:
            ok = ok & (j <= i)
        elif mode == 3:
            ok = ok & (j <= i + (s2 - s1))
        elif mode == 4:
            # Both window bounds are inclusive: pre_tokens=P admits P older keys plus the
            # diagonal (P + 1 keys with next_tokens=0). unconfirmed: derived from the operator
            # documentation's figures and error checks, not observed on hardware.
            diag = i + (s2 - s1)
            ok = ok & (j >= diag - self.pre_tokens) & (j <= diag + self.next_tokens)
        return ok


def _mask_window(mask: Tensor, rows: range, num_keys: int) -> Tensor:
    """mask[:, rows, :num_keys]; positions beyond the mask (padding only) count as masked."""
    part = mask[:, rows.start : rows.stop, :num_keys]
    if part.shape[1] == len(rows) and part.shape[2] == num_keys:
        return part
    full = torch.ones((mask.shape[0], len(rows), num_keys), dtype=torch.bool, device=mask.device)
    full[:, : part.shape[1], : part.shape[2]] = part
    return full


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    admission: Admission,
    q_rope: Tensor | None = None,
    k_rope: Tensor | None = None,
    sink: Tensor | None = None,
    pse_shift: Tensor | None = None,
    need_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Attention of padded requests.

    Args:
        q, k, v: [B, N, Sq, D], [B, KVN, Skv, D], [B, KVN, Skv, Dv].
        q_lens, kv_lens: per-request actual lengths (<= Sq, <= Skv).
        scale: multiplies q.k (and q_rope.k_rope) before the softmax.
        admission: the masking rule.
        q_rope, k_rope: MLA rope parts [B, N, Sq, Dr], [B, KVN, Skv, Dr], added to the scores.
        sink: per query head logit [N] (already in score units, not scaled).
        pse_shift: additive bias broadcastable to [B, N, Sq, Skv].

        need_lse: compute the lse; without it (and without sink/pse) the masked softmax runs
            in PyTorch's fused SDPA kernel, which reads the gathered strided KV in place.

    Returns:
        out fp32 [B, N, Sq, Dv] (zeros in padding rows and in rows with no admitted key) and
        lse fp32 [B, N, Sq] (natural log of the softmax denominator; -inf for empty rows), or
        None when not needed.
    """
    k, v, k_rope = _unread_keys_dropped(k, v, k_rope, kv_lens)
    if not need_lse and sink is None and pse_shift is None:
        if q_rope is not None:
            values_are_keys = v is k
            # scale * (q.k + q_rope.k_rope) == scale * [q, q_rope].[k, k_rope]
            q = torch.cat((q, q_rope), dim=-1)
            k = torch.cat((k, k_rope), dim=-1)
            if values_are_keys:
                # MLA's value is its key latent: attend with [k, k_rope] as the values too (one
                # head dim for q, k and v, which PyTorch's fast kernels need) and keep the
                # latent part of the output.
                dv = v.shape[-1]
                return _fused(q, k, k, q_lens, kv_lens, scale, admission)[..., :dv], None
        return _fused(q, k, v, q_lens, kv_lens, scale, admission), None
    q_lens_t, kv_lens_t = _as_tensor(q_lens, q.device), _as_tensor(kv_lens, q.device)
    b, n, sq, _ = q.shape
    kvn, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = n // kvn
    kf = k.float().unsqueeze(2).transpose(-1, -2)  # [B, KVN, 1, D, Skv]
    vf = v.float().unsqueeze(2)  # [B, KVN, 1, Skv, Dv]
    krf = k_rope.float().unsqueeze(2).transpose(-1, -2) if k_rope is not None else None
    sink_f = sink.float().view(1, kvn, g, 1) if sink is not None else None

    out = q.new_zeros((b, n, sq, dv), dtype=torch.float32)
    lse = q.new_full((b, n, sq), float("-inf"), dtype=torch.float32)
    rows_per_chunk = max(1, _SCORE_BUDGET // max(1, b * n * skv))
    for r0 in range(0, sq, rows_per_chunk):
        rows = range(r0, min(sq, r0 + rows_per_chunk))
        qc = q[:, :, rows.start : rows.stop].float().view(b, kvn, g, len(rows), -1)
        scores = torch.matmul(qc, kf)  # [B, KVN, G, R, Skv]
        if krf is not None:
            qr = q_rope[:, :, rows.start : rows.stop].float().view(b, kvn, g, len(rows), -1)
            scores = scores + torch.matmul(qr, krf)
        scores = scores * scale
        if pse_shift is not None:
            # unconfirmed: whether the hardware adds pse_shift before or after `scale`;
            # the reference adds it to the scaled scores.
            bias = pse_shift[..., rows.start : rows.stop, :skv].float()
            scores = scores + bias.expand(b, n, len(rows), skv).view(b, kvn, g, len(rows), skv)
        ok = admission.allowed(rows, skv, q_lens_t, kv_lens_t)[:, None, None]  # [B,1,1,R,Skv]
        scores = scores.masked_fill(~ok, float("-inf"))
        if skv:
            row_max = scores.amax(dim=-1)  # [B, KVN, G, R]
        else:  # no keys at all (empty KV): every row is empty
            row_max = scores.new_full(scores.shape[:-1], float("-inf"))
        if sink_f is not None:
            row_max = torch.maximum(row_max, sink_f)
        # Rows with no admitted key (and no sink) have max -inf; shift by 0 to avoid NaN.
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        probs = torch.exp(scores - row_max.unsqueeze(-1))
        denom = probs.sum(dim=-1)
        if sink_f is not None:
            denom = denom + torch.exp(sink_f - row_max)
        weighted = torch.matmul(probs, vf)  # [B, KVN, G, R, Dv]
        # unconfirmed: the device output for rows with no admitted key (docs say accuracy
        # "may be lost" without invalid-row correction; most likely zeros). The reference
        # writes zeros and lse = -inf there.
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        chunk = weighted / safe.unsqueeze(-1)
        out[:, :, rows.start : rows.stop] = chunk.reshape(b, n, len(rows), dv)
        # unconfirmed: whether the device lse includes the sink term; the reference includes
        # it, so that out == sum_j exp(s_j - lse) v_j holds in every case.
        chunk_lse = torch.where(denom > 0, row_max + torch.log(safe), float("-inf"))
        lse[:, :, rows.start : rows.stop] = chunk_lse.reshape(b, n, len(rows))
    return out, lse


def _unread_keys_dropped(
    k: Tensor, v: Tensor, k_rope: Tensor | None, kv_lens: list[int]
) -> tuple[Tensor, Tensor, Tensor | None]:
    """K/V without the keys no request reads, and zeros for the values a request does not read.

    The device reads key j of request b only for j < kv_lens[b]. A cache allocated with
    ``torch.empty`` (the framework's Legacy ``init_cache``) holds arbitrary bits there, and
    a NaN or inf there would still poison the result (0 * inf = NaN). Keys past every
    request's length are sliced off (a view, no copy); keys and values past a shorter
    request's own length are zeroed, only when they hold a non-finite value.
    """
    skv = k.shape[2]
    top = max(kv_lens, default=0)
    if top < skv:
        k, v = k[:, :, :top], v[:, :, :top]
        k_rope = k_rope[:, :, :top] if k_rope is not None else None
    if min(kv_lens, default=top) < top:
        read = torch.arange(top, device=v.device) < _as_tensor(kv_lens, v.device).view(-1, 1)
        unread = ~read.view(-1, 1, top, 1)
        k, v = _finite_where_read(k, unread), _finite_where_read(v, unread)
        k_rope = _finite_where_read(k_rope, unread) if k_rope is not None else None
    return k, v, k_rope


def _finite_where_read(t: Tensor, unread: Tensor) -> Tensor:
    # NOTE: SDPA adds its boolean mask as -inf, and NaN + -inf is NaN: unread keys must be
    # finite too, not only unread values. The copy is made only when something is non-finite.
    return t if bool(torch.isfinite(t).all()) else t.masked_fill(unread, 0.0)


def _fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    adm: Admission,
) -> Tensor:
    """Masked attention through SDPA in fp32; rows without an admitted key become zeros.

    GQA runs as grouped queries: the G query heads sharing a kv head become G x R query rows
    of that kv head ([B, KVN, G*R, D]), so each key/value row is read once per kv head
    instead of being expanded G times. The mask is the same for every head.
    """
    b, n, sq, d = q.shape
    kvn, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = n // kvn
    kf, vf = k.float(), v.float()
    if _plain_causal(adm, q_lens, kv_lens, sq, skv):
        # Every request is a full causal square: the kernel's own causal path skips the
        # masked half instead of computing it under a mask.
        return F.scaled_dot_product_attention(
            q.float(), kf, vf, is_causal=True, scale=scale, enable_gqa=kvn != n
        )
    if newest_rows_only(adm, q_lens, sq):
        return _attend_newest(q.float(), kf, vf, kv_lens, scale)
    if _chunk_after_prefix(adm, q_lens, kv_lens, sq, skv):
        return _attend_chunk(q.float(), kf, vf, scale)
    if _bottom_right_batch(adm, q_lens):
        return _attend_each_request(q.float(), kf, vf, q_lens, kv_lens, scale)
    q_lens_t, kv_lens_t = _as_tensor(q_lens, q.device), _as_tensor(kv_lens, q.device)
    out = q.new_zeros((b, n, sq, dv), dtype=torch.float32)
    rows_per_chunk = max(1, _MASK_BUDGET // max(1, b * g * skv))
    for r0 in range(0, sq, rows_per_chunk):
        rows = range(r0, min(sq, r0 + rows_per_chunk))
        r = len(rows)
        ok = adm.allowed(rows, skv, q_lens_t, kv_lens_t)  # [B, R, Skv]
        qg = q[:, :, rows.start : rows.stop].float().reshape(b, kvn, g * r, d)
        mask = ok.unsqueeze(1).expand(b, g, r, skv).reshape(b, 1, g * r, skv)
        chunk = F.scaled_dot_product_attention(qg, kf, vf, attn_mask=mask, scale=scale)
        chunk = chunk.view(b, n, r, dv)
        # unconfirmed: device output for rows with no admitted key (most likely zeros).
        has_key = ok.any(dim=-1)[:, None, :, None]
        out[:, :, rows.start : rows.stop] = torch.where(has_key, chunk, torch.zeros_like(chunk))
    return out


def _attend_newest(q: Tensor, k: Tensor, v: Tensor, kv_lens: list[int], scale: float) -> Tensor:
    """One query row per request that sees exactly its first kv_lens[b] keys (decode)."""
    b, n, _, d = q.shape
    kvn, skv = k.shape[1], k.shape[2]
    qg = q.reshape(b, kvn, n // kvn, d)
    mask = None
    if min(kv_lens) != skv or max(kv_lens) != skv:
        kv_t = _as_tensor(kv_lens, q.device)
        mask = (torch.arange(skv, device=q.device) < kv_t.view(-1, 1)).view(b, 1, 1, skv)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out = out.view(b, n, 1, v.shape[3])
    if min(kv_lens) == 0:
        # unconfirmed: device output for rows with no admitted key (most likely zeros).
        empty = _as_tensor(kv_lens, q.device).eq(0).view(b, 1, 1, 1)
        out = out.masked_fill(empty, 0.0)
    return out


def _attend_each_request(
    q: Tensor, k: Tensor, v: Tensor, q_lens: list[int], kv_lens: list[int], scale: float
) -> Tensor:
    """Bottom-right causal attention request by request, on each one's own rows and keys.

    A batch of prefill chunks after cached prefixes (prefix-cache hits, chunked prefill next
    to new prompts) padded to its longest query and key lengths is mostly padding; a masked
    call over the whole padded batch computed every padded score. Here each request runs
    the path of its own shape: a full causal square, one newest row, or a chunk after a
    prefix. Padding rows stay zeros, as on the masked path.
    """
    b, n, sq, _ = q.shape
    out = q.new_zeros((b, n, sq, v.shape[3]), dtype=torch.float32)
    for i, (s1, s2) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if s1 == 0 or s2 == 0:
            continue  # no query row, or no key for any row: zeros, like the masked path
        qi, ki, vi = q[i : i + 1, :, :s1], k[i : i + 1, :, :s2], v[i : i + 1, :, :s2]
        if s1 == s2:
            part = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=k.shape[1] != n
            )
        elif s1 == 1:
            part = _attend_newest(qi, ki, vi, [s2], scale)
        elif s1 < s2:
            part = _attend_chunk(qi, ki, vi, scale)
        else:
            # More queries than keys: the first s1 - s2 rows see no key (zeros); the rest
            # are a causal square over the keys.
            part = qi.new_zeros((1, n, s1, v.shape[3]))
            part[:, :, s1 - s2 :] = F.scaled_dot_product_attention(
                qi[:, :, s1 - s2 :],
                ki,
                vi,
                is_causal=True,
                scale=scale,
                enable_gqa=k.shape[1] != n,
            )
        out[i : i + 1, :, :s1] = part
    return out


def _attend_chunk(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One request's chunk of S queries after P = Skv - S cached keys, bottom-right causal."""
    parts = attend_chunk_with_lse(q, k, v, scale)
    if parts is None:
        return _attend_chunk_masked(q, k, v, scale)
    return parts[0]


def attend_chunk_with_lse(
    q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor] | None:
    """(out, lse) of one request's S queries over Skv >= S keys, bottom-right causal.

    Every query sees the first P = Skv - S keys (a cached prefix) and the last S causally.
    Both halves run without a mask (the prefix in full, the chunk on the kernel's causal
    path) and are merged by their log-sum-exps, instead of one masked call over all Skv
    keys. None where PyTorch has no CPU flash kernel (see ``flash_with_lse``).
    """
    sq, skv = q.shape[2], k.shape[2]
    p = skv - sq
    if p == 0:
        return flash_with_lse(q, k, v, scale, causal=True)
    parts = (
        flash_with_lse(q, k[:, :, :p], v[:, :, :p], scale, causal=False),
        flash_with_lse(q, k[:, :, p:], v[:, :, p:], scale, causal=True),
    )
    if parts[0] is None or parts[1] is None:
        return None
    return merge_by_lse(*parts)


def merge_by_lse(*parts: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Attention over disjoint key sets merged into attention over their union.

    Each part is (out [..., S, Dv], lse [..., S]) of the same query rows: the merged output
    weighs each part by its share exp(lse_i) of the total softmax denominator.
    """
    top = parts[0][1]
    for _, lse in parts[1:]:
        top = torch.maximum(top, lse)
    weights = [torch.exp(lse - top).unsqueeze(-1) for _, lse in parts]
    total = weights[0]
    acc = parts[0][0] * weights[0]
    for (out, _), w in zip(parts[1:], weights[1:], strict=True):
        acc = acc + out * w
        total = total + w
    return acc / total, top + torch.log(total.squeeze(-1))


def flash_with_lse(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *, causal: bool
) -> tuple[Tensor, Tensor] | None:
    """(output, natural-log lse [B, N, S]) from PyTorch's CPU flash kernel, if it has one.

    The kernel takes fewer kv heads than query heads and pairs query head h with kv head
    h // G, as the operator does. It is a private ATen op: without it the caller falls back.
    """
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if kernel is None or q.device.type != "cpu" or v.shape[-1] != q.shape[-1]:
        return None  # the kernel also needs one head dim for q, k and v (not MLA's)
    out, lse = kernel(q, k, v, is_causal=causal, scale=scale)[:2]
    return out, lse


def _attend_chunk_masked(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    sq, skv = q.shape[2], k.shape[2]
    i = torch.arange(sq, device=q.device).view(-1, 1)
    j = torch.arange(skv, device=q.device).view(1, -1)
    mask = j <= i + (skv - sq)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def _chunk_after_prefix(
    adm: Admission, q_lens: list[int], kv_lens: list[int], sq: int, skv: int
) -> bool:
    """True for one request whose chunk follows cached keys under plain bottom-right causality."""
    if len(q_lens) != 1 or adm.decode_branch or adm.sparse_mode != 3:
        return False
    return q_lens[0] == sq and kv_lens[0] == skv and 0 < sq < skv


def _bottom_right_batch(adm: Admission, q_lens: list[int]) -> bool:
    """True for several requests under plain bottom-right causality (sparse mode 3).

    Run request by request, such a batch was faster than one masked call over its padding in
    every shape measured (2 threads, 16 heads over 8 kv heads of 128): 8 new prompts of
    16-256 tokens 58 -> 14 ms, 4 of 16-64 tokens 5.9 -> 1.6 ms, 29 chunks of 16-64 tokens
    after a 1024-token cached prefix 138 -> 101 ms, one chunk among 16 decode rows 51 -> 6 ms.
    """
    return len(q_lens) >= 2 and not adm.decode_branch and adm.sparse_mode == 3


def newest_rows_only(adm: Admission, q_lens: list[int], sq: int) -> bool:
    """True when every request has one query row that admits exactly its keys j < kv_len.

    Sparse mode 3 aligns the causal diagonal bottom-right, so a single query row (the newest
    token) sees every key; so does mode 0 without a mask (no masking at all) and the decode
    branch without a key mask.
    """
    if sq != 1 or min(q_lens, default=0) != 1:
        return False
    if adm.decode_branch:
        return adm.key_mask is None
    return adm.sparse_mode == 3 or (adm.sparse_mode == 0 and adm.user_mask is None)


def _as_tensor(lens: list[int], device: torch.device) -> Tensor:
    return torch.tensor(lens, dtype=torch.int64, device=device)


def _plain_causal(adm: Admission, q_lens: list[int], kv_lens: list[int], sq: int, skv: int) -> bool:
    """True when the rule is causal on full, equal squares (no padding, no window)."""
    if adm.decode_branch or adm.sparse_mode not in (2, 3) or sq != skv or sq == 0:
        return False
    return min(q_lens) == max(q_lens) == sq and min(kv_lens) == max(kv_lens) == skv
