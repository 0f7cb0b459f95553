"""Shape limits of torch_npu 2.13.0's fused attention, as facts both sides read.

The runtime's reference operators enforce them on every call (``runtime/ops/reference/
npu_limits.py``); the analyzer puts the ones a model's shapes hit into the Plan before anything
is written (``analyzer/op_limits.py``). Each value cites the section of the operator's docs in
the wheel (``torch_npu/_op_plugin_docs.py``, Chinese; the heading is quoted); references/
npu_ops.md §9 lists them with the places where vllm-ascend's running code departs from them.
"""

from __future__ import annotations

#: 约束说明 › 当Q_S大于1时 / 当Q_S等于1时: "N轴小于等于256", "D轴小于等于512", "B轴小于等于65536"
MAX_HEADS = 256
MAX_HEAD_DIM = 512
MAX_BATCH = 65536
#: 约束说明 › page attention场景: the (blocknum, blocksize, H) cache form needs KV_N*D <= 65535;
#: BSH/BSND queries with Q_S > 1 need N*D < 65535
MAX_HIDDEN = 65535
#: learnable_sink (v2 only): 参数约束 "仅支持value的d小于等于128"; the reference keeps its older,
#: stricter 64 or 128
SINK_VALUE_DIMS = (64, 128)
#: MLA (query_rope/key_rope): rope head dim 64; the latent (query) head dim 512, or 128
#: (v2 › 当query的d等于128时)
MLA_ROPE_DIM = 64
MLA_LATENT_DIMS = (512, 128)
#: v2 › 当query的d等于512时 (v1: › query_rope和key_rope参数约束, sparse不为4时): 1..16 query
#: tokens per request; query heads 32/64/128 (v1) or 1..128 powers of two (v2); block_size 16
#: or 128 (the NZ cache: 128 only)
MLA_LATENT_DIM = 512
MLA_MAX_QUERY_TOKENS = 16
MLA_V1_HEADS = (32, 64, 128)
MLA_V2_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
MLA_BLOCK_SIZES = (16, 128)
MLA_NZ_BLOCK_SIZES = (128,)
#: v1 › query_rope和key_rope参数约束 › sparse为4时 (a band on the absorbed latent; Q_S 1 with
#: "sparse=4且传入mask" too): query N 128, D 512; key N 1, D 512, S <= 131088; key/value ND
#: only (no NZ); input_layout BSND only; PageAttention block_size 64 or 128
MLA_BAND_HEADS = 128
MLA_BAND_BLOCK_SIZES = (64, 128)
MLA_BAND_MAX_KV = 131088
#: TND without page attention (the un-absorbed MLA prefill). v1 › TND场景下query、key、value输入的
#: 综合限制: "N等于8/16/32/64/128, 且Q_N、K_N、V_N相等", "Q_D、K_D等于192, V_D等于128/192",
#: "T小于等于65536", bf16 only; v2 › 当query的d不等于512时: "Q_D、K_D、V_D等于128, 或者Q_D、K_D等于
#: 192, V_D等于128/192", "T小于等于1M"
TND_V1_HEADS = (8, 16, 32, 64, 128)
TND_V1_DIMS = {192: (128, 192)}
TND_V2_DIMS = {128: (128,), 192: (128, 192)}
TND_V1_MAX_TOKENS = 65536
TND_V2_MAX_TOKENS = 1 << 20
#: page attention block sizes: 当Q_S大于1时 "block_size最小为128, 最大为512, 且要求是128的倍数";
#: 当Q_S等于1时 "block_size需要传入非0值, 且最大不超过512, ...需要16对齐"
PREFILL_BLOCK_MULTIPLE = 128
DECODE_BLOCK_MULTIPLE = 16
MAX_PAGED_BLOCK = 512
#: 当Q_S大于1时: "输入类型全为float16、bfloat16时, D轴需16对齐"
PROMPT_HEAD_DIM_MULTIPLE = 16
#: query/key/value dtypes (int8 quantised paths aside): fp32 is a CPU-only convenience
NPU_FLOAT_DTYPES = ("float16", "bfloat16")

#: npu_lightning_indexer / npu_sparse_flash_attention (the DSA pair), wheel doc › sparse_count:
#: "支持1-2048以及3072、4096、5120、6144、7168、8192"
SPARSE_COUNT_MAX_RANGE = 2048
SPARSE_COUNT_EXTRA = (3072, 4096, 5120, 6144, 7168, 8192)


def sparse_count_allowed(count: int) -> bool:
    """Whether the lightning indexer keeps COUNT positions per query (its ``sparse_count``)."""
    return 1 <= count <= SPARSE_COUNT_MAX_RANGE or count in SPARSE_COUNT_EXTRA


#: kernel docs of the pair (hicann/ops-transformer, 约束说明, Atlas A2/A3): the indexer's key
#: head dim "headdim支持128" with "query Q_N支持小于等于64"; the sparse attention's latent
#: "Q_D和key、value的KV_D值相等为512", rope "Dr值相等为64", "Q_N支持1/2/4/8/16/32/64/128"; both
#: page blocks "block_size取值为16的倍数，最大支持1024"
INDEXER_HEAD_DIM = 128
INDEXER_MAX_QUERY_HEADS = 64
SFA_LATENT_DIM = 512
SFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SPARSE_BLOCK_MULTIPLE = 16
SPARSE_MAX_BLOCK_SIZE = 1024
