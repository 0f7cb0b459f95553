"""Paged FA computed in request groups gives the same attention as one padded batch."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import cpu_kernels
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import batch_groups, fused_attention
from ops_golden import (
    CAUSAL_TILE,
    INT_MAX,
    make_mla_paged_case,
    make_paged_case,
    naive_batch,
    naive_request,
    paged_fia_v1,
    rule_for,
)

# Spread lengths, so that splitting the batch saves padding.
SHAPES = {
    "decode": ([1, 1, 1, 1, 1], [3, 40, 7, 25, 1]),
    "prefill": ([12, 2, 30, 5], [12, 2, 30, 5]),
    "chunked": ([3, 1, 9], [20, 2, 9]),
    "mixed": ([1, 14, 1, 2], [33, 14, 4, 2]),
}


@pytest.fixture
def always_split(monkeypatch):
    """Groups cost nothing extra: the planner splits whenever padding can be saved.

    Decode calls stay on the PyTorch path (the compiled decode kernel would take them), and
    TND prefills too (the packed request-by-request path would).
    """
    monkeypatch.setattr(fused_attention, "_prefill_packed", lambda *args: None)
    monkeypatch.setattr(batch_groups, "GROUP_OVERHEAD", 0)
    batch_groups._plan.cache_clear()
    calls = []
    original = fused_attention._attend_in_groups

    def spy(*args, **kwargs):
        calls.append(len(args[-1]))
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "_attend_in_groups", spy)
    with cpu_kernels.disabled():
        yield calls
    batch_groups._plan.cache_clear()


def _call(case, mode, *, pre=INT_MAX, nxt=INT_MAX, lse=False):
    return paged_fia_v1(
        case, num_heads=4, num_kv_heads=2, scale=0.3, mode=mode, pre=pre, nxt=nxt, lse=lse
    )


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode,pre,nxt", [(3, INT_MAX, INT_MAX), (4, 4, 0), (0, INT_MAX, INT_MAX)])
@pytest.mark.parametrize("lse", [False, True])
def test_grouped_matches_naive(always_split, shape, mode, pre, nxt, lse):
    q_lens, kv_lens = SHAPES[shape]
    case = make_paged_case(
        q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=7
    )
    out, got_lse = _call(case, mode, pre=pre, nxt=nxt, lse=lse)
    assert always_split and always_split[0] > 1, "the batch was not split"
    want, want_lse = naive_batch(case, 0.3, rule_for(mode, pre, nxt))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    if lse:
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(
            got_lse[..., 0].double()[finite], want_lse[finite], atol=2e-5, rtol=0
        )
        assert torch.isneginf(got_lse[..., 0][~finite]).all()


def test_grouped_equals_one_batch(monkeypatch):
    q_lens, kv_lens = SHAPES["mixed"]
    case = make_paged_case(
        q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=9
    )
    monkeypatch.setattr(fused_attention, "plan_groups", lambda *a: None)
    whole, whole_lse = _call(case, 3, lse=True)
    monkeypatch.undo()
    monkeypatch.setattr(batch_groups, "GROUP_OVERHEAD", 0)
    batch_groups._plan.cache_clear()
    grouped, grouped_lse = _call(case, 3, lse=True)
    batch_groups._plan.cache_clear()
    torch.testing.assert_close(grouped, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grouped_lse, whole_lse, atol=1e-6, rtol=1e-6)


def test_per_request_key_mask_follows_its_request(always_split):
    # Decode branch (BSH, one token each) with a (B, KV_S) mask: each group must read its own rows.
    q_lens, kv_lens = [1, 1, 1, 1], [30, 2, 17, 5]
    case = make_paged_case(
        q_lens, kv_lens, num_heads=2, num_kv_heads=2, head_dim=8, block_size=4, seed=4
    )
    nb, bs = case.key_cache.shape[:2]
    width = case.block_table.size(1) * bs
    key_mask = torch.zeros(4, width, dtype=torch.bool)
    key_mask[0, :10] = True
    key_mask[2, 3] = True
    query = case.query_tnd.reshape(4, 1, -1)
    out, _ = npu.npu_fused_infer_attention_score(
        query,
        case.key_cache.view(nb, bs, -1),
        case.value_cache.view(nb, bs, -1),
        num_heads=2,
        num_key_value_heads=2,
        input_layout="BSH",
        scale=0.5,
        atten_mask=key_mask,
        block_table=case.block_table,
        block_size=bs,
        actual_seq_lengths_kv=kv_lens,
    )
    assert always_split, "the batch was not split"
    for b in range(4):
        keep = ~key_mask[b, : kv_lens[b]]
        k = case.ks[b][keep].double()
        v = case.vs[b][keep].double()
        q = case.query_tnd[b].double()  # [N, D]
        probs = torch.softmax(torch.einsum("hd,shd->hs", q, k) * 0.5, dim=-1)
        want = torch.einsum("hs,shd->hd", probs, v)
        torch.testing.assert_close(out[b, 0].double().view(2, 8), want, atol=2e-5, rtol=0)


def test_plan_keeps_uniform_batches_whole():
    assert batch_groups.plan_groups([1] * 16, [160] * 16, 256, torch.device("cpu")) is None
    assert batch_groups.plan_groups([128] * 8, [128] * 8, 256, torch.device("cpu")) is None
    assert batch_groups.plan_groups([1], [4000], 256, torch.device("cpu")) is None


def test_plan_splits_spread_decode_and_covers_every_request_once():
    kv = [16 + 12 * i for i in range(32)]
    groups = batch_groups.plan_groups([1] * 32, kv, 256, torch.device("cpu"))
    assert groups is not None and len(groups) > 1
    members = sorted(m for g in groups for m in g.members)
    assert members == list(range(32))
    for g in groups:
        assert g.kv_lens == [kv[m] for m in g.members]
        assert g.index.tolist() == list(g.members)
    # Longest first: no group's longest request is longer than a previous group's shortest.
    for earlier, later in zip(groups, groups[1:], strict=False):
        assert max(later.kv_lens) <= min(earlier.kv_lens)


@pytest.mark.parametrize("q_len,kv_len", [(5, 13), (1, 2), (16, 17), (7, 7)])
def test_lone_chunk_after_cached_keys_matches_naive(q_len, kv_len):
    # One request, bottom-right causal: the prefix and the chunk are computed apart and merged.
    case = make_paged_case(
        [q_len], [kv_len], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=11
    )
    out, _ = _call(case, 3)
    want, _ = naive_batch(case, 0.3, rule_for(3))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("values", ["the latent", "their own"])
@pytest.mark.parametrize("q_lens,kv_lens,mode", [([1, 1], [9, 4], 0), ([3, 2], [3, 6], 3)])
def test_mla_values_are_the_latent_or_their_own(values, q_lens, kv_lens, mode):
    # Absorbed MLA passes one latent cache as key and value; a separate value cache must still
    # be read as such.
    latent, rope = make_mla_paged_case(q_lens, kv_lens, num_heads=4, block_size=4, seed=5)
    nb, bs = latent.key_cache.shape[:2]
    key = latent.key_cache.view(nb, bs, -1)
    value = key if values == "the latent" else latent.value_cache.view(nb, bs, -1)
    out, _ = npu.npu_fused_infer_attention_score(
        latent.query_tnd,
        key,
        value,
        query_rope=rope.query_tnd,
        key_rope=rope.key_cache.view(nb, bs, -1),
        num_heads=4,
        num_key_value_heads=1,
        input_layout="TND",
        scale=0.05,
        atten_mask=CAUSAL_TILE if mode else None,
        sparse_mode=mode,
        block_table=latent.block_table,
        block_size=bs,
        actual_seq_lengths=latent.cu_q,
        actual_seq_lengths_kv=kv_lens,
    )
    start = 0
    for b, s1 in enumerate(q_lens):
        v = latent.ks[b] if values == "the latent" else latent.vs[b]
        want, _ = naive_request(
            latent.qs[b],
            latent.ks[b],
            v,
            0.05,
            rule_for(mode),
            q_rope=rope.qs[b],
            k_rope=rope.ks[b],
        )
        torch.testing.assert_close(out[start : start + s1].double(), want, atol=1e-4, rtol=1e-4)
        start += s1
