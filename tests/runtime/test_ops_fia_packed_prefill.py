"""Paged prefill over blocks every request shares: one pass over the shared prefix, merged."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops.reference import OpInputError, fused_attention, packed_prefill
from ops_golden import (
    CAUSAL_TILE,
    INT_MAX,
    make_paged_case,
    naive_batch,
    paged_fia_v1,
    rule_for,
)

BLOCK = 4


@pytest.fixture
def answered(monkeypatch):
    """Small prefixes count. Records whether the packed path answered each call ("answered")
    and how many blocks it found shared ("shared")."""
    monkeypatch.setattr(packed_prefill, "MIN_SHARED_TOKENS", 2 * BLOCK)
    record: dict[str, list] = {"answered": [], "shared": []}
    original, original_shared = fused_attention.attend_packed, packed_prefill.shared_blocks

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        record["answered"].append(out is not None)
        return out

    def spy_shared(*args, **kwargs):
        count = original_shared(*args, **kwargs)
        record["shared"].append(count)
        return count

    monkeypatch.setattr(fused_attention, "attend_packed", spy)
    monkeypatch.setattr(packed_prefill, "shared_blocks", spy_shared)
    return record


def _shared_case(q_lens, kv_lens, shared_blocks, *, seed=3):
    """Requests whose first ``shared_blocks`` table columns are request 0's blocks."""
    case = make_paged_case(
        q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=BLOCK, seed=seed
    )
    n = shared_blocks * BLOCK
    for b in range(1, len(q_lens)):
        case.block_table[b, :shared_blocks] = case.block_table[0, :shared_blocks]
        case.ks[b][:n] = case.ks[0][:n]
        case.vs[b][:n] = case.vs[0][:n]
    return case


@pytest.mark.parametrize(
    "q_lens,kv_lens,shared",
    [
        ([5, 1, 9, 3], [29, 20, 33, 17], 3),  # chunks after cached own tokens, one decode row
        ([4, 6], [16, 18], 3),  # own keys are exactly the chunk (a causal square)
        ([7, 2, 3], [40, 44, 13], 2),  # the shortest cached part caps the shared span
    ],
)
def test_shared_prefix_matches_naive(answered, q_lens, kv_lens, shared):
    case = _shared_case(q_lens, kv_lens, shared)
    out, _ = paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
    want, _ = naive_batch(case, 0.3, rule_for(3))
    assert answered == {"answered": [True], "shared": [shared]}
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "q_lens,kv_lens",
    [
        ([12, 2, 30, 5], [12, 2, 30, 5]),  # new prompts of different lengths
        ([3, 1, 9], [20, 2, 9]),  # a chunk after its cached tokens, a decode row, a prompt
        ([64], [64]),
    ],
)
def test_requests_without_a_shared_prefix_match_naive(answered, q_lens, kv_lens):
    case = make_paged_case(
        q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=BLOCK, seed=5
    )
    out, _ = paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
    want, _ = naive_batch(case, 0.3, rule_for(3))
    assert answered["answered"] == [True] and answered["shared"] == [0]
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_shared_blocks_stops_at_the_first_differing_column(monkeypatch):
    monkeypatch.setattr(packed_prefill, "MIN_SHARED_TOKENS", 2 * BLOCK)
    table = torch.tensor([[7, 8, 9, 10, 11], [7, 8, 9, 3, 4], [7, 8, 9, 10, 5]], dtype=torch.int32)
    assert packed_prefill.shared_blocks(table, [1, 1, 1], [20, 20, 20], BLOCK) == 3
    # request 1's query rows start inside block 2 (kv 14 - q 5 = 9 cached tokens): cap 2
    assert packed_prefill.shared_blocks(table, [1, 5, 1], [20, 14, 20], BLOCK) == 2
    # under the minimum, one request, or nothing shared: the general path
    assert packed_prefill.shared_blocks(table, [1, 9, 1], [20, 14, 20], BLOCK) == 0
    assert packed_prefill.shared_blocks(table[:1], [1], [20], BLOCK) == 0
    assert packed_prefill.shared_blocks(table[[0, 1]].flip(0), [1, 1], [20, 20], BLOCK) == 3
    other = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    assert packed_prefill.shared_blocks(other, [1, 1], [12, 12], BLOCK) == 0


@pytest.mark.parametrize("mode,pre,nxt,lse", [(3, INT_MAX, INT_MAX, True), (4, 5, 0, False)])
def test_lse_or_a_window_takes_the_general_path(answered, mode, pre, nxt, lse):
    case = _shared_case([5, 3, 9], [29, 20, 33], 3)
    out, got_lse = paged_fia_v1(
        case, num_heads=4, num_kv_heads=2, scale=0.3, mode=mode, pre=pre, nxt=nxt, lse=lse
    )
    want, want_lse = naive_batch(case, 0.3, rule_for(mode, pre, nxt))
    assert answered["answered"] == []
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    if lse:
        torch.testing.assert_close(got_lse[..., 0].double(), want_lse, atol=2e-5, rtol=0)


def test_more_query_rows_than_keys_takes_the_general_path(answered):
    case = make_paged_case(
        [6, 3], [4, 9], num_heads=4, num_kv_heads=2, head_dim=8, block_size=BLOCK, seed=2
    )
    out, _ = paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)
    want, _ = naive_batch(case, 0.3, rule_for(3))
    assert answered["answered"] == []
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_a_shared_block_outside_the_cache_is_an_operator_error(answered):
    case = _shared_case([5, 3, 9], [29, 20, 33], 3)
    case.block_table[:, 1] = case.key_cache.shape[0] + 5
    with pytest.raises(OpInputError, match="block_table row 0 names a block outside"):
        paged_fia_v1(case, num_heads=4, num_kv_heads=2, scale=0.3, mode=3)


@pytest.mark.parametrize(
    "width,message",
    [
        (2 * 6, "query head dim 8 differs from key head dim 6"),
        (13, "key cache hidden size 13 is not divisible by num_key_value_heads=2"),
    ],
)
def test_a_cache_of_the_wrong_width_gets_the_operators_message(answered, width, message):
    from kvskill.runtime.ops import reference as npu

    case = make_paged_case([5, 3], [9, 7], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    cache = torch.randn(case.key_cache.shape[0], BLOCK, width)
    with pytest.raises(OpInputError, match=message):
        npu.npu_fused_infer_attention_score(
            case.query_tnd, cache, cache, num_heads=4, num_key_value_heads=2,
            input_layout="TND", scale=0.3, sparse_mode=3, atten_mask=CAUSAL_TILE,
            block_table=case.block_table, block_size=BLOCK,
            actual_seq_lengths=case.cu_q, actual_seq_lengths_kv=case.kv_lens,
        )  # fmt: skip
