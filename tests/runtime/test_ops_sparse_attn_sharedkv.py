"""custom.npu_sparse_attn_sharedkv (+ its metadata) against per-token loops: window, compressed
and selected entries with sinks, over paged caches with shuffled block tables, and its limits."""

from __future__ import annotations

import math

import pytest
import torch
from kvskill.runtime.ops.npu_standin import npu_standin
from kvskill.runtime.ops.reference import OpInputError
from kvskill.runtime.ops.reference.custom import (
    npu_sparse_attn_sharedkv,
    npu_sparse_attn_sharedkv_metadata,
)
from kvskill.runtime.ops.reference.npu_profile import npu_limits

I32 = torch.int32
WINDOW = 128  # ori_win_left 127 + the token itself


def paged(rows_per_request, block_size, seed):
    """Each request's rows [L, D] in a shared cache, blocks handed out in shuffled order."""
    need = [max(1, -(-r.size(0) // block_size)) for r in rows_per_request]
    order = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(seed))
    dim = rows_per_request[0].size(-1)
    cache = torch.randn(sum(need) + 3, block_size, 1, dim)  # unused rows hold noise
    table = torch.zeros(len(need), max(need), dtype=I32)
    used = 0
    for b, rows in enumerate(rows_per_request):
        for j in range(need[b]):
            table[b, j] = int(order[used])
            used += 1
        for t in range(rows.size(0)):
            cache[int(table[b, t // block_size]), t % block_size, 0] = rows[t]
    return cache, table


def naive(q, ori, cmp, ratio, selected, sinks, scale):
    """One request: q [S, N, D], window rows [L, D], compressed rows [E, D] -> [S, N, D]."""
    s, heads = q.size(0), q.size(1)
    length = ori.size(0)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(s):
        p = length - s + i
        keys = [ori[j] for j in range(max(0, p - WINDOW + 1), p + 1)]
        if cmp is not None:
            limit = (p + 1) // ratio
            chosen = range(limit) if selected is None else [int(e) for e in selected[i]]
            keys += [cmp[e] for e in chosen if 0 <= e < limit]
        stacked = torch.stack(keys).double()  # the row's keys, listed one by one above
        for h in range(heads):
            logits = stacked @ q[i, h].double() * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            weights = (logits - logits.max()).exp()
            weights = weights[: len(keys)] / weights.sum()  # the sink weighs no value
            out[i, h] = weights @ stacked
    return out


def plan(q, cmp_ratio=-1, topk=0, has_cmp=True, layout_q="TND", cu=None, seqused=None):
    return npu_sparse_attn_sharedkv_metadata(
        q.size(-2), 1, q.size(-1), cu_seqlens_q=cu, seqused_kv=seqused, cmp_topk=topk,
        cmp_ratio=cmp_ratio, layout_q=layout_q, has_cmp_kv=has_cmp,
    )  # fmt: skip


def test_hca_prefill_sees_its_window_and_every_finished_entry_with_sinks():
    torch.manual_seed(0)
    heads, dim, ratio = 2, 8, 128
    lengths, q_lens = [300, 140], [20, 140]  # request 0: a late chunk; request 1: a prompt
    ori = [torch.randn(n, dim) for n in lengths]
    cmp = [torch.randn(n // ratio, dim) for n in lengths]
    ori_kv, ori_table = paged(ori, 16, seed=1)
    cmp_kv, cmp_table = paged(cmp, 16, seed=2)
    q = torch.randn(sum(q_lens), heads, dim)
    sinks = torch.randn(heads)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=I32)
    seqused = torch.tensor(lengths, dtype=I32)
    out, lse = npu_sparse_attn_sharedkv(
        q, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_block_table=ori_table, cmp_block_table=cmp_table,
        cu_seqlens_q=cu, seqused_kv=seqused, sinks=sinks, softmax_scale=0.3, cmp_ratio=ratio,
        metadata=plan(q, ratio, cu=cu, seqused=seqused), layout_q="TND",
    )  # fmt: skip
    assert out.shape == q.shape and lse.numel() == 0
    want = torch.cat([
        naive(q[: q_lens[0]], ori[0], cmp[0], ratio, None, sinks, 0.3),
        naive(q[q_lens[0] :], ori[1], cmp[1], ratio, None, sinks, 0.3),
    ])  # fmt: skip
    assert (out.double() - want).abs().max() < 1e-5


def test_csa_decode_attends_only_the_selected_finished_entries():
    torch.manual_seed(1)
    heads, dim, ratio = 2, 8, 4
    lengths = [150, 23]
    ori = [torch.randn(n, dim) for n in lengths]
    cmp = [torch.randn(n // ratio, dim) for n in lengths]
    ori_kv, ori_table = paged(ori, 16, seed=3)
    cmp_kv, cmp_table = paged(cmp, 16, seed=4)
    q = torch.randn(2, 1, heads, dim)  # BSND decode: one token per request
    # request 0 picks 5 of its 37 entries; request 1 lists one unfinished entry (5: its 23
    # tokens finish entries 0..4) that must stay masked, then -1 padding
    selected = torch.tensor([[[[36, 0, 17, 9, 30, -1]]], [[[4, 5, 1, -1, -1, -1]]]], dtype=I32)
    seqused = torch.tensor(lengths, dtype=I32)
    out, _ = npu_sparse_attn_sharedkv(
        q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=selected, ori_block_table=ori_table,
        cmp_block_table=cmp_table, seqused_kv=seqused, cmp_ratio=ratio,
        metadata=plan(q, ratio, topk=6, layout_q="BSND", seqused=seqused), layout_q="BSND",
    )  # fmt: skip
    scale = 1 / math.sqrt(dim)  # softmax_scale 0: the doc's default 1/sqrt(D)
    for b in range(2):
        want = naive(q[b], ori[b], cmp[b], ratio, selected[b, :, 0], None, scale)
        assert (out[b].double() - want).abs().max() < 1e-5


def test_csa_prefill_masks_listed_entries_a_row_has_not_finished():
    torch.manual_seed(4)
    ori, cmp = [torch.randn(10, 8)], [torch.randn(2, 8)]
    ori_kv, ori_table = paged(ori, 16, seed=8)
    cmp_kv, cmp_table = paged(cmp, 16, seed=9)
    q = torch.randn(10, 2, 8)
    # every row lists both entries; rows 0-2 finish neither, rows 3-6 only entry 0
    selected = torch.tensor([[1, 0, -1]], dtype=I32).repeat(10, 1).view(10, 1, 3)
    cu, seqused = torch.tensor([0, 10], dtype=I32), torch.tensor([10], dtype=I32)
    out, _ = npu_sparse_attn_sharedkv(
        q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=selected, ori_block_table=ori_table,
        cmp_block_table=cmp_table, cu_seqlens_q=cu, seqused_kv=seqused, cmp_ratio=4,
        metadata=plan(q, 4, topk=3, cu=cu, seqused=seqused), layout_q="TND",
    )  # fmt: skip
    want = naive(q, ori[0], cmp[0], 4, selected[:, 0], None, 1 / math.sqrt(8))
    assert (out.double() - want).abs().max() < 1e-5


def test_sliding_layer_through_the_dispatcher_matches_a_direct_call():
    torch.manual_seed(2)
    heads, dim = 2, 8
    ori = [torch.randn(140, dim)]
    ori_kv, table = paged(ori, 32, seed=5)
    q = torch.randn(4, heads, dim)
    cu, seqused = torch.tensor([0, 4], dtype=I32), torch.tensor([140], dtype=I32)
    with npu_standin():
        import custom_ops  # noqa: F401  (what the framework's model imports)

        meta = torch.ops.custom.npu_sparse_attn_sharedkv_metadata(
            num_heads_q=heads, num_heads_kv=1, head_dim=dim, cu_seqlens_q=cu, seqused_kv=seqused,
            layout_q="TND", has_cmp_kv=False,
        )  # fmt: skip
        out, _ = torch.ops.custom.npu_sparse_attn_sharedkv(
            q, ori_kv=ori_kv, ori_block_table=table, cu_seqlens_q=cu, seqused_kv=seqused,
            metadata=meta, softmax_scale=0.5, layout_q="TND",
        )  # fmt: skip
    want = naive(q, ori[0], None, 0, None, None, 0.5)
    assert (out.double() - want).abs().max() < 1e-5


def _call(**change):
    torch.manual_seed(3)
    q = torch.randn(1, 2, 2, 8)
    ori_kv, table = paged([torch.randn(20, 8)], 16, seed=6)
    cmp_kv, cmp_table = paged([torch.randn(5, 8)], 16, seed=7)
    seqused = torch.tensor([20], dtype=I32)
    args = dict(
        ori_kv=ori_kv, cmp_kv=cmp_kv, ori_block_table=table, cmp_block_table=cmp_table,
        seqused_kv=seqused, cmp_ratio=4, layout_q="BSND",
        metadata=plan(q, 4, layout_q="BSND", seqused=seqused),
    )  # fmt: skip
    args.update(change)
    return npu_sparse_attn_sharedkv(q, **args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ori_win_left": 63}, "ori_win_left takes only 127"),
        ({"cmp_mask_mode": 0}, "cmp_mask_mode takes only 3"),
        ({"cmp_ratio": 8}, "cmp_ratio must be one of [4, 128]"),
        ({"layout_kv": "PA_BSND"}, "layout_kv takes only 'PA_ND'"),
        ({"metadata": None}, "`metadata` is required"),
        ({"sinks": torch.zeros(2, dtype=torch.bfloat16)}, "sinks must be float32"),
        ({"ori_sparse_indices": torch.zeros(1, 2, 1, 4, dtype=I32)}, "the device ignores it"),
        ({"return_softmax_lse": True}, "not supported by the operator yet"),
        ({"cmp_kv": None, "cmp_block_table": None}, "made for has_cmp_kv=1"),
        ({"seqused_kv": torch.tensor([1], dtype=I32)}, "shorter than the request's 2"),
    ],
)
def test_documented_limits_are_refused_in_one_line(change, message):
    with pytest.raises(OpInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _call(**change)


def test_hardware_limits_hold_under_the_npu_profile():
    with npu_limits(), pytest.raises(OpInputError, match="q must have 64 heads of dim 512"):
        _call(metadata=torch.zeros(1024, dtype=I32))
    with npu_limits(), pytest.raises(OpInputError, match="multiple of 16"):
        npu_sparse_attn_sharedkv(torch.randn(1, 1, 64, 512), ori_kv=torch.randn(2, 8, 1, 512),
                                 ori_block_table=torch.zeros(1, 1, dtype=I32))  # fmt: skip


def test_the_fake_gives_shapes_without_reading_values():
    meta = {"device": "meta"}  # meta tensors dispatch to the registered fake: no values
    with npu_standin():
        q = torch.empty(5, 2, 8, **meta)
        out, lse = torch.ops.custom.npu_sparse_attn_sharedkv(
            q, ori_kv=torch.empty(3, 16, 1, 8, **meta),
            ori_block_table=torch.empty(1, 3, dtype=I32, **meta),
            metadata=torch.empty(1024, dtype=I32, **meta), layout_q="TND",
        )  # fmt: skip
        plan = torch.ops.custom.npu_sparse_attn_sharedkv_metadata(
            2, 1, 8, seqused_kv=torch.empty(1, dtype=I32, **meta)
        )
    assert out.shape == (5, 2, 8) and lse.shape == (0,) and plan.shape == (1024,)
    assert out.device.type == "meta" and plan.dtype == I32
