"""Sliding-window release against the paged fused attention: null blocks are never attended."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime import (
    NULL_BLOCK_ID,
    KVCacheManager,
    get_init_attn_mask,
    prepare_block_tables,
    prepare_slot_mapping,
    prepare_token_positions,
)
from kvskill.runtime.ops import torch_npu
from runtime_factories import Sink, attn_layer, model_info

HEADS, DIM, BS = 2, 4, 2


def _naive_window(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int):
    """Each query at position p (the last rows of the history) sees keys (p - W, p]."""
    total, out = keys.shape[0], []
    for i in range(q.shape[0]):
        p = total - q.shape[0] + i
        lo = max(0, p - window + 1)
        scores = torch.einsum("hd,khd->hk", q[i], keys[lo : p + 1]) * DIM**-0.5
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values[lo : p + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize(("window", "prompt"), [(3, 5), (4, 2), (5, 9)])
def test_decode_with_released_blocks_matches_windowed_attention(window, prompt, hybrid):
    sink = Sink()
    layer = attn_layer(
        sink, 0, "SlidingWindow", num_head=HEADS, head_dim=DIM, sliding_window=window
    )
    mgr = KVCacheManager(
        model_info([layer], BS), num_blocks=40, use_hybrid_blocks=hybrid, free_block_order_seed=1
    )
    mgr.allocate_cache_tensors()
    k_cache, v_cache = sink.tensors[(0, "k_cache")], sink.tensors[(0, "v_cache")]
    # Garbage in the null block: any read of a released position would show in the output.
    k_cache[NULL_BLOCK_ID] = 1e4
    v_cache[NULL_BLOCK_ID] = -1e4
    gen = torch.Generator().manual_seed(window * 100 + prompt)
    keys = torch.empty(0, HEADS, DIM)
    values = torch.empty(0, HEADS, DIM)
    computed, new = 0, prompt
    for _ in range(12):
        assert mgr.allocate_slots("r", computed + new, num_computed_tokens=computed) is not None
        ids = mgr.get_block_ids("r")["SlidingWindow"]
        table = prepare_block_tables([ids])
        req, pos = prepare_token_positions(torch.tensor([computed]), torch.tensor([new]))
        slots = prepare_slot_mapping(table, req, pos, BS)
        q, k, v = (torch.randn(new, HEADS, DIM, generator=gen) for _ in range(3))
        keys, values = torch.cat([keys, k]), torch.cat([values, v])
        index = torch.stack([slots // BS, slots % BS], dim=-1)
        torch_npu.npu_scatter_nd_update_(k_cache, index, k)
        torch_npu.npu_scatter_nd_update_(v_cache, index, v)
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q,
            k_cache.view(40, BS, -1),
            v_cache.view(40, BS, -1),
            num_heads=HEADS,
            num_key_value_heads=HEADS,
            input_layout="TND",
            scale=DIM**-0.5,
            atten_mask=get_init_attn_mask(2048, kind="band"),
            sparse_mode=4,
            pre_tokens=window - 1,
            next_tokens=0,
            block_table=table,
            block_size=BS,
            actual_seq_lengths=[new],
            actual_seq_lengths_kv=[computed + new],
        )
        expected = _naive_window(q, keys, values, window)
        torch.testing.assert_close(out.view(new, HEADS, DIM), expected, atol=1e-5, rtol=1e-5)
        computed, new = computed + new, 1
    # Long past the prompt, blocks were released and the live count stayed bounded.
    assert NULL_BLOCK_ID in ids
    assert sum(b != NULL_BLOCK_ID for b in ids) <= -(-window // BS) + 1
