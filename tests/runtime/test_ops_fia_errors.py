"""FA strictness: inputs the device rejects are rejected here too, with a clear message."""

from __future__ import annotations

import pytest
import torch
from kvskill.runtime.ops import reference as npu
from kvskill.runtime.ops.reference import OpInputError, ReferenceUnsupportedError
from ops_golden import CAUSAL_TILE, make_paged_case

N, KVN, D, BS = 4, 2, 16, 4
CASE = make_paged_case([2, 3], [5, 6], num_heads=N, num_kv_heads=KVN, head_dim=D, block_size=BS)
NB = CASE.key_cache.shape[0]
K3 = CASE.key_cache.view(NB, BS, -1)
V3 = CASE.value_cache.view(NB, BS, -1)


def v1(**overrides):
    kwargs = dict(
        num_heads=N,
        num_key_value_heads=KVN,
        input_layout="TND",
        scale=0.3,
        atten_mask=CAUSAL_TILE,
        sparse_mode=3,
        block_table=CASE.block_table,
        block_size=BS,
        actual_seq_lengths=CASE.cu_q,
        actual_seq_lengths_kv=CASE.kv_lens,
    )
    q = overrides.pop("query", CASE.query_tnd)
    k = overrides.pop("key", K3)
    kwargs.update(overrides)
    return npu.npu_fused_infer_attention_score(q, k, V3, **kwargs)


def test_the_baseline_call_is_valid():
    out, _ = v1()
    assert out.shape == (5, N, D)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"atten_mask": CAUSAL_TILE.float()}, "bool, int8 or uint8.*float32"),
        ({"atten_mask": CAUSAL_TILE[:1024, :1024]}, r"sparse_mode=3 needs atten_mask of shape"),
        ({"atten_mask": None}, "sparse_mode=3 needs atten_mask"),
        (
            {"atten_mask": CAUSAL_TILE, "sparse_mode": 4, "pre_tokens": -1, "next_tokens": -1},
            "both negative",
        ),
        ({"atten_mask": ~CAUSAL_TILE}, "must be triu"),
        ({"sparse_mode": 5}, "sparse_mode must be one of 0..4"),
        ({"actual_seq_lengths": [2, 3]}, r"cumulative with last value = T = 5.*per-request"),
        ({"actual_seq_lengths": [0, 2, 5]}, "leading 0"),
        ({"actual_seq_lengths": None}, "requires actual_seq_lengths"),
        ({"actual_seq_lengths_kv": [5, 20]}, r"does not fit the block table.*not cumulative"),
        ({"actual_seq_lengths_kv": None}, "requires actual_seq_lengths_kv"),
        ({"block_size": 8}, "block_size=8 but the paged key cache"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
        ({"num_heads": 0}, "num_heads must be > 0"),
        ({"input_layout": "SBH"}, "input_layout 'SBH' is not supported"),
        ({"query": CASE.query_tnd.view(5, N * D)}, "needs a 3-D query"),
        (
            {
                "key": CASE.key_cache.permute(0, 2, 1, 3).contiguous(),
                "input_layout": "BSH",
                "query": CASE.query_tnd[:2].reshape(2, 1, N * D),
                "actual_seq_lengths": None,
            },
            "needs the 3-D cache",
        ),
    ],
)
def test_rejected_inputs(overrides, match):
    with pytest.raises(OpInputError, match=match):
        v1(**overrides)


def test_messages_use_the_v2_names_for_v2():
    with pytest.raises(OpInputError, match="actual_seq_qlen"):
        npu.npu_fused_infer_attention_score_v2(
            CASE.query_tnd,
            K3,
            V3,
            num_query_heads=N,
            num_key_value_heads=KVN,
            input_layout="TND",
            block_table=CASE.block_table,
            block_size=BS,
            actual_seq_kvlen=CASE.kv_lens,
        )


def test_mode1_needs_a_mask_and_mode0_mask_must_cover_the_lengths():
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(OpInputError, match="sparse_mode=1 needs atten_mask"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", sparse_mode=1
        )
    with pytest.raises(OpInputError, match=r"Q_S >= 3 and KV_S >= 3"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", atten_mask=torch.zeros(2, 2, dtype=bool)
        )


def test_mode0_window_that_masks_every_row_is_rejected():
    q = torch.randn(1, 3, 2, 8)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    with pytest.raises(OpInputError, match="next_tokens=-3"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", atten_mask=mask, pre_tokens=5, next_tokens=-3
        )


def test_decode_branch_mode2_is_rejected():
    # unconfirmed on device (most likely the mask batch check fires).
    q = torch.randn(2, 1, 2, 8)
    with pytest.raises(OpInputError, match="sparse_mode=2 with a single query token"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", atten_mask=CAUSAL_TILE, sparse_mode=2
        )


class TestMla:
    q = torch.randn(3, 2, 128)

    def call(self, **kw):
        k = torch.randn(3, 1, 128)
        return npu.npu_fused_infer_attention_score(
            kw.pop("query", self.q),
            k,
            k,
            num_heads=2,
            num_key_value_heads=1,
            input_layout="TND",
            actual_seq_lengths=[3],
            actual_seq_lengths_kv=[3],
            **kw,
        )

    def test_rope_without_key_rope(self):
        with pytest.raises(OpInputError, match="`query_rope` was passed without `key_rope`"):
            self.call(query_rope=torch.randn(3, 2, 64))

    def test_key_rope_without_query_rope(self):
        with pytest.raises(OpInputError, match="`key_rope` was passed without `query_rope`"):
            self.call(key_rope=torch.randn(3, 1, 64))

    def test_rope_dim_must_be_64(self):
        with pytest.raises(OpInputError, match="`query_rope` head dim must be 64, got 32"):
            self.call(query_rope=torch.randn(3, 2, 32), key_rope=torch.randn(3, 1, 32))

    def test_nope_dim_must_be_512_or_128(self):
        with pytest.raises(OpInputError, match=r"one of \(512, 128\), got 96"):
            npu.npu_fused_infer_attention_score(
                torch.randn(3, 2, 96),
                torch.randn(3, 1, 96),
                torch.randn(3, 1, 96),
                query_rope=torch.randn(3, 2, 64),
                key_rope=torch.randn(3, 1, 64),
                num_heads=2,
                num_key_value_heads=1,
                input_layout="TND",
                actual_seq_lengths=[3],
                actual_seq_lengths_kv=[3],
            )

    def test_valid_mla_call(self):
        out, _ = self.call(query_rope=torch.randn(3, 2, 64), key_rope=torch.randn(3, 1, 64))
        assert out.shape == (3, 2, 128)


@pytest.mark.parametrize(
    "kw",
    [
        {"antiquant_scale": torch.ones(1)},
        {"key_antiquant_mode": 1},
        {"quant_scale2": torch.ones(1)},
        {"key_shared_prefix": torch.ones(1)},
        {"query_padding_size": torch.zeros(1, dtype=torch.int64)},
    ],
)
def test_v1_quant_and_prefix_keywords_are_accepted_but_rejected_when_used(kw):
    with pytest.raises(ReferenceUnsupportedError, match="not supported by the reference backend"):
        v1(**kw)


def test_v2_quant_keywords_rejected_when_used_and_sink_constraints():
    base = dict(
        num_query_heads=N,
        num_key_value_heads=KVN,
        input_layout="TND",
        block_table=CASE.block_table,
        block_size=BS,
        actual_seq_qlen=CASE.cu_q,
        actual_seq_kvlen=CASE.kv_lens,
    )
    with pytest.raises(ReferenceUnsupportedError, match="dequant_scale_key"):
        npu.npu_fused_infer_attention_score_v2(
            CASE.query_tnd, K3, V3, dequant_scale_key=torch.ones(1), **base
        )
    # Explicit defaults are fine.
    npu.npu_fused_infer_attention_score_v2(
        CASE.query_tnd, K3, V3, key_quant_mode=0, dequant_scale_key=None, **base
    )
    with pytest.raises(OpInputError, match="value head dim 64 or 128, got 16"):
        npu.npu_fused_infer_attention_score_v2(
            CASE.query_tnd, K3, V3, learnable_sink=torch.zeros(N), **base
        )
    q = torch.randn(2, 1, 2, 64)
    with pytest.raises(OpInputError, match="learnable_sink needs input_layout 'TND'"):
        npu.npu_fused_infer_attention_score_v2(
            q, q, q, num_query_heads=2, input_layout="BSND", learnable_sink=torch.zeros(2)
        )


def test_sparse_mode_9_is_outside_the_reference():
    with pytest.raises(ReferenceUnsupportedError, match="sparse_mode=9"):
        v1(sparse_mode=9)


def test_lengths_must_be_int_lists():
    with pytest.raises(TypeError, match="must be a list of ints"):
        v1(actual_seq_lengths=[2.0, 5.0])
    # A 1-D integer tensor is accepted (converted on the host).
    out, _ = v1(actual_seq_lengths=torch.tensor(CASE.cu_q))
    assert out.shape == (5, N, D)
