"""The golden matrix: layout x KV form x sparse mode, cycling GQA ratio, query shape and dtype.

Every (layout, KV form, mode) combination runs; the GQA ratio (1, 4, all-to-one), the query
shape (decode, prefill q = kv, chunked q < kv, mixed) and the dtype cycle through the cases
so each value meets every layout and mode more than once.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from ops_golden import (
    CAUSAL_TILE,
    make_paged_case,
    naive_request,
    pack,
    rule_for,
    tolerance,
    unpack,
)

LAYOUTS = ["BSH", "BSND", "BNSD", "TND", "TND_NTD"]
KV_FORMS = ["dense", "paged3d", "paged4d", "pagednz"]
MODES = [0, 1, 2, 3, 4]
HEADS = [(4, 4), (8, 2), (4, 1)]
SHAPES = [([1, 1], [5, 9]), ([4, 6], [4, 6]), ([2, 3], [7, 5]), ([1, 4], [6, 4])]
DTYPES = [torch.float32, torch.float32, torch.float16, torch.float32, torch.bfloat16]
PRE, NEXT = 2, 0
D, BS = 16, 4


def _combos():
    for n, (layout, form, mode) in enumerate(itertools.product(LAYOUTS, KV_FORMS, MODES)):
        if form in ("paged4d",) and layout in ("BSH", "BSND"):
            continue  # BSH/BSND queries need the 3-D (or NZ) paged cache
        yield pytest.param(
            layout,
            form,
            mode,
            HEADS[n % 3],
            SHAPES[n % 4],
            DTYPES[n % 5],
            n,
            id=f"{layout}-{form}-m{mode}-g{HEADS[n % 3]}-q{SHAPES[n % 4][0]}-{DTYPES[n % 5]}",
        )


def _kv_tensors(case, form, layout, kvn):
    if form == "dense":
        q_layout = layout.partition("_")[0]
        pad = max(case.kv_lens)
        return pack(case.ks, q_layout, pad), pack(case.vs, q_layout, pad)
    nb = case.key_cache.shape[0]
    out = []
    for cache in (case.key_cache, case.value_cache):
        if form == "paged3d":
            out.append(cache.view(nb, BS, -1))
        elif form == "paged4d":
            out.append(cache.permute(0, 2, 1, 3).contiguous())
        else:  # NZ: [nb, Nkv, D // 16, bs, 16]
            out.append(cache.view(nb, BS, kvn, D // 16, 16).permute(0, 2, 3, 1, 4).contiguous())
    return out


@pytest.mark.parametrize("layout,form,mode,heads,shape,dtype,seed", list(_combos()))
def test_matrix(layout, form, mode, heads, shape, dtype, seed):
    n, kvn = heads
    q_lens, kv_lens = shape
    case = make_paged_case(
        q_lens,
        kv_lens,
        num_heads=n,
        num_kv_heads=kvn,
        head_dim=D,
        block_size=BS,
        dtype=dtype,
        seed=seed,
    )
    q_layout, _, out_layout = layout.partition("_")
    packed = q_layout == "TND"
    decode_branch = not packed and max(q_lens) == 1
    if decode_branch and mode in (1, 2):
        pytest.skip("single-query kernel: modes 1/2 are covered by the decode-branch tests")
    q = pack(case.qs, q_layout, max(q_lens))
    key, value = _kv_tensors(case, form, layout, kvn)
    cum = lambda xs: torch.tensor(xs).cumsum(0).tolist()  # noqa: E731
    kwargs = dict(
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout=layout,
        scale=0.25,
        sparse_mode=mode,
        pre_tokens=PRE,
        next_tokens=NEXT,
        actual_seq_lengths=cum(q_lens) if packed else q_lens,
    )
    gen = torch.Generator().manual_seed(1)
    user_mask = torch.rand(max(q_lens), max(kv_lens), generator=gen) > 0.6
    if mode == 1:
        kwargs["atten_mask"] = user_mask
    elif mode >= 2:
        kwargs["atten_mask"] = CAUSAL_TILE
    if form == "dense":
        kwargs["actual_seq_lengths_kv"] = cum(kv_lens) if packed else kv_lens
    else:
        kwargs.update(block_table=case.block_table, block_size=BS, actual_seq_lengths_kv=kv_lens)
    if packed and max(q_lens) > 1 and mode in (1, 2):
        # packed prefill takes modes 0 (no mask), 3 and 4 only (npu_ops.md §9)
        with pytest.raises(npu.OpInputError, match="takes sparse_mode 0 without a mask or 3/4"):
            npu.npu_fused_infer_attention_score(q, key, value, **kwargs)
        return
    out, _ = npu.npu_fused_infer_attention_score(q, key, value, **kwargs)
    assert out.dtype == dtype
    if decode_branch or mode == 0:
        rule = rule_for(0)  # decode kernel ignores mode/window; mode 0 without mask: all keys
    elif mode == 1:
        rule = lambda i, j, s1, s2: not user_mask[i, j]  # noqa: E731
    else:
        rule = rule_for(mode, PRE, NEXT)
    got = unpack(out, out_layout or q_layout, q_lens, n)
    for b in range(len(q_lens)):
        want, _ = naive_request(case.qs[b], case.ks[b], case.vs[b], 0.25, rule)
        torch.testing.assert_close(got[b].double(), want, **tolerance(dtype))
