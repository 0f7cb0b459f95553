"""The two fused-attention operators' names and how their keywords differ (npu_ops.md §2.2).

``npu_fused_infer_attention_score`` (v1) and ``npu_fused_infer_attention_score_v2`` take the
same inputs under partly different keywords. The reference operators, the implementer (which
writes the calls) and lint (which checks hand-written ones) all read these tables.
"""

from __future__ import annotations

FA_V1 = "npu_fused_infer_attention_score"
FA_V2 = "npu_fused_infer_attention_score_v2"

#: renamed keywords, v1 name -> v2 name
V1_TO_V2: dict[str, str] = {
    "num_heads": "num_query_heads",
    "scale": "softmax_scale",
    "actual_seq_lengths": "actual_seq_qlen",
    "actual_seq_lengths_kv": "actual_seq_kvlen",
    "softmax_lse_flag": "return_softmax_lse",
    "key_antiquant_scale": "dequant_scale_key",
    "key_antiquant_offset": "dequant_offset_key",
    "value_antiquant_scale": "dequant_scale_value",
    "value_antiquant_offset": "dequant_offset_value",
    "key_antiquant_mode": "key_quant_mode",
    "value_antiquant_mode": "value_quant_mode",
    "key_rope_antiquant_scale": "dequant_scale_key_rope",
    "quant_scale2": "quant_scale_out",
    "quant_offset2": "quant_offset_out",
}
#: renamed keywords, v2 name -> v1 name
V2_TO_V1: dict[str, str] = {v2: v1 for v1, v2 in V1_TO_V2.items()}
#: keywords only v1 takes
V1_ONLY = frozenset(
    {
        "dequant_scale1",
        "quant_scale1",
        "dequant_scale2",
        "antiquant_scale",
        "antiquant_offset",
        "antiquant_mode",
        "query_padding_size",
        "kv_padding_size",
        "key_shared_prefix",
        "value_shared_prefix",
        "actual_shared_prefix_len",
    }
)
#: keywords only v2 takes
V2_ONLY = frozenset(
    {"learnable_sink", "dequant_scale_query", "query_quant_mode", "quant_scale_p", "out_dtype"}
)
