"""Dry runs of converted families against a stand-in torch_npu that checks what the real one would.

Every operator call binds against torch_npu 2.13.0's schema and passes the documented limits
under the strict NPU profile (bf16, block size 128, head dims the device takes), or the run
fails: a conversion that verifies on the CPU reference but that the NPU would reject shows up
here. Outputs are zeros, so only the calls are checked, not the numerics.

Every family of the README's supported-models table runs in framework mode and in both
standalone modes (paged runner, contiguous BSH runner). A (family, mode) that kvskill does not
convert is not skipped: its refusal is asserted, with the reason it gives.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import fake_torch_npu
import pytest
import torch
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime import LLM, SamplingParams
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "implementer"))
from remote_model import write_remote_model  # noqa: E402

pytestmark = pytest.mark.slow

#: the operator's paged block size: prefill needs a multiple of 128 on the device
BLOCK = 128
#: small decoders whose head dims (64) and counts the device takes
DENSE = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
}
#: gated delta net layers (Mamba group) before a full-attention layer
GATED_DELTA = {
    **DENSE,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}
#: MLA with DeepSeek's head dims: the absorbed decode takes the 512 + 64 latent with 32 query
#: heads; the un-absorbed prefill takes Q_D = K_D = 128 + 64 = 192 and V_D = 128 (npu_ops §9)
MLA = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 512,
}
MLA_MOE = {
    **MLA,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 128,
}
REMOTE = "tiny_remote"
#: the README's supported-models table, each with NPU-sized overrides
FAMILIES = {
    "llama": DENSE,
    "qwen2": DENSE,
    "qwen3": DENSE,
    "mistral": {**DENSE, "sliding_window": 64},
    "qwen3_moe": {
        **DENSE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    },
    "mixtral": {**DENSE, "num_local_experts": 4, "num_experts_per_tok": 2},
    # learnable sinks (FA v2), sliding and full layers
    "gpt_oss": {
        **DENSE,
        "sliding_window": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_next": {
        **GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    # a composite (vision-language) config: the decoder's part is text_config
    "qwen3_5": {"text_config": GATED_DELTA},
    # Kimi delta attention layers before an MLA layer
    "kimi_linear": {
        **MLA,
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "dense"],
        "linear_num_heads": 4,
        "linear_head_dim": 64,
        "q_lora_rank": None,
        # its default special ids lie past the small vocabulary
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "deepseek_v3": MLA_MOE,
    "deepseek_v2": MLA_MOE,
    # DSA: the indexer's 64 heads of 128 over its own paged key cache, top-2048 (the sparse
    # attention's sparse_count); glm_moe_dsa's every layer runs its indexer by default
    "deepseek_v32": {**MLA_MOE, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048},
    "glm_moe_dsa": {**MLA_MOE, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048},
    # DSA without q-LoRA, its per-position query rescale, and a NoPE layer (zero rope inputs)
    "mistral_large4": {
        "text_config": {
            **MLA_MOE,
            "num_hidden_layers": 4,
            "q_lora_rank": None,
            "index_n_heads": 64,
            "index_head_dim": 128,
            "index_topk": 2048,
            "layer_types": ["indexed_attention"] * 4,
            "indexer_types": ["full"] * 4,
            "no_rope_layers": [1, 1, 1, 0],
            "kv_source_layers": [0, 1, 2, 3],
        },
        # the vision tower has no cache; at its default size (30 layers of 2048) building it
        # took most of these rows' time
        "vision_config": {
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 32,
        },
    },
    # GLM-5.3: a Kimi delta attention layer, then MLA without rope (zero rope inputs of 64)
    # read through a k-pool indexer (pools of 16 as sparse_block_size, 128 pools kept)
    "glm5_next": {
        "text_config": {
            **MLA_MOE,
            "qk_rope_head_dim": 0,
            "layer_types": ["linear_attention", "indexed_attention"],
            "indexer_types": ["full", "full"],
            "mlp_layer_types": ["dense", "sparse"],
            "linear_num_heads": 4,
            "linear_head_dim": 64,
            "index_n_heads": 64,
            "index_head_dim": 128,
            "index_topk": 2048,
            "index_kpool": 16,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 64,
            "num_heads": 2,
            "intermediate_size": 64,
            "projection_intermediate_size": 64,
        },
    },
    # compressed attention: an HCA and a CSA layer with the operators' head dim 512 (one K = V
    # head), 64 query heads, the indexer's 64 heads of 128 and top-512; small elsewhere
    "deepseek_v4": {
        "num_hidden_layers": 2,
        "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
        "hidden_size": 1024,
        "q_lora_rank": 128,
        "o_lora_rank": 128,
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 512,
        "num_nextn_predict_layers": 0,
    },
    # the remote-code row: its own config is NPU-sized already (4 / 2 heads of 64)
    REMOTE: {},
}
#: families whose paged caches need a larger block on the device: glm5_next's pooled keys
#: hold block_size // 16 rows per block, and npu_lightning_indexer pages in multiples of 16
FAMILY_BLOCK = {"glm5_next": 256}
#: framework, standalone over the paged runner, standalone over the contiguous (BSH) runner
MODES = ("framework", "standalone-paged", "standalone-contiguous")
_STATE_LAYERS = "recurrent-state (Mamba) layers are converted in framework mode only"
_V4_FRAMEWORK_ONLY = "compressed attention (DeepSeek-V4) is rewritten for framework mode only"
_MLA_PAGED_ONLY = "absorbed MLA attention is generated over the paged latent caches only"
# npu_ops §1.4/§1.5: with BSH and one query token the operator runs its decode branch, which
# ignores sparse_mode and pre/next tokens, so a window cannot be applied in decode
_BSH_WINDOW = "decode branch, which ignores sparse_mode and pre_tokens/next_tokens"
#: (family, mode) -> the refusal apply gives; every other pair must convert and pass
REFUSED = {
    ("qwen3_next", "standalone-paged"): _STATE_LAYERS,
    ("qwen3_next", "standalone-contiguous"): _STATE_LAYERS,
    ("qwen3_5", "standalone-paged"): _STATE_LAYERS,
    ("qwen3_5", "standalone-contiguous"): _STATE_LAYERS,
    ("kimi_linear", "standalone-paged"): _STATE_LAYERS,
    ("kimi_linear", "standalone-contiguous"): _STATE_LAYERS,
    ("deepseek_v3", "standalone-contiguous"): _MLA_PAGED_ONLY,
    ("deepseek_v2", "standalone-contiguous"): _MLA_PAGED_ONLY,
    ("deepseek_v32", "standalone-contiguous"): _MLA_PAGED_ONLY,
    ("glm_moe_dsa", "standalone-contiguous"): _MLA_PAGED_ONLY,
    ("mistral_large4", "standalone-contiguous"): _MLA_PAGED_ONLY,
    ("glm5_next", "standalone-paged"): _STATE_LAYERS,
    ("glm5_next", "standalone-contiguous"): _STATE_LAYERS,
    ("deepseek_v4", "standalone-paged"): _V4_FRAMEWORK_ONLY,
    ("deepseek_v4", "standalone-contiguous"): _V4_FRAMEWORK_ONLY,
    ("mistral", "standalone-contiguous"): _BSH_WINDOW,
    ("gpt_oss", "standalone-contiguous"): _BSH_WINDOW,
}
#: families whose attention hands the operator a strided (transposed-view) query. The docs say
#: query, key, value, query_rope and key_rope "不支持非连续的Tensor" (no non-contiguous tensors);
#: whether the device copies or refuses one is unconfirmed, so the reference does not refuse
#: it and this table records where it happens (npu_ops.md §9). Paged caches are not counted:
#: the page pool's strided views are the same open question.
STRIDED_QUERY = {"gpt_oss", "qwen3_next", "qwen3_5"}
#: a prompt inside one block and one spanning two, so prefill packs both and decode follows
PROMPTS = [list(range(1, 20)), list(range(1, 150))]
#: absorbed MLA on the device: 1..16 query tokens per request (npu_ops §9)
MLA_MAX_QUERY_TOKENS = 16


@pytest.fixture
def fake_npu(monkeypatch):
    log = fake_torch_npu.CallLog()
    fake_torch_npu.install(monkeypatch, log)
    return log


def _convert(tmp_path: Path, family: str, mode: str, overrides: dict | None = None) -> Path:
    model = str(write_remote_model(tmp_path / "source")) if family == REMOTE else family
    out = tmp_path / f"{family}-{mode}"
    deploy, _, kv_mode = mode.partition("-")
    options = ApplyOptions(
        deploy_mode=deploy,
        kv_mode=kv_mode or "paged",
        config_overrides=FAMILIES[family] if overrides is None else overrides,
    )
    apply_model(model, out, options)
    return out


def _generate(directory: Path, *, dtype: str = "bfloat16", block_size: int = BLOCK, **kwargs):
    llm = LLM(
        directory,
        random_weights=True,
        dtype=dtype,
        device="cpu",
        block_size=block_size,
        num_blocks=8 * BLOCK // block_size,
        freeze_startup_heap=False,
        trust_remote_code=True,
        **{k: v for k, v in kwargs.items() if k != "prompts"},
    )
    return llm.generate(kwargs.get("prompts", PROMPTS), SamplingParams(max_tokens=2))


def _attention_calls(log: fake_torch_npu.CallLog) -> list[dict]:
    return (
        log.of("npu_fused_infer_attention_score")
        + log.of("npu_fused_infer_attention_score_v2")
        + log.of("npu_sparse_flash_attention")
        # the framework's V4 attention names its query q and the query's layout layout_q
        + [
            b | {"query": b["q"], "layout_query": b["layout_q"]}
            for b in log.of("npu_sparse_attn_sharedkv")
        ]
    )


def _query_tokens(bound: dict) -> int:
    layout = bound.get("input_layout") or bound["layout_query"]
    if layout.startswith(("TND", "NTD")):
        return bound["query"].size(0 if layout.startswith("TND") else 1)
    return bound["query"].size(0) * bound["query"].size(1)  # BSH: B x S


def _strided_query(calls: list[dict]) -> bool:
    """Whether some call passed a non-contiguous query or query_rope (or unpaged key/value)."""
    names = ("query", "query_rope", "key", "value")
    return any(
        isinstance(b.get(name), torch.Tensor) and not b[name].is_contiguous()
        for b in calls
        for name in (names if b.get("block_table") is None else names[:2])
    )


def _cache_writes(log: fake_torch_npu.CallLog) -> int:
    ops = ("npu_scatter_nd_update_", "scatter_update_", "npu_kv_rmsnorm_rope_cache")
    return sum(len(log.of(op)) for op in ops)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_conversion_makes_only_calls_the_npu_accepts(tmp_path, fake_npu, family, mode):
    refusal = REFUSED.get((family, mode))
    if refusal is not None:
        with pytest.raises(UnsupportedModelError, match=re.escape(refusal)):
            _convert(tmp_path, family, mode)
        assert fake_npu.calls == []
        return
    out = _convert(tmp_path, family, mode)
    block = FAMILY_BLOCK.get(family, BLOCK)
    if mode == "framework":
        results = _generate(out, block_size=block)
        assert [len(r.token_ids) for r in results] == [2, 2]
    else:
        options = VerifyOptions(
            shrink=False,
            block_size=BLOCK,
            dtype="bfloat16",
            num_prompts=2,
            max_new_tokens=2,
            trust_remote_code=True,
        )
        report = verify_directory(out, options)
        # tokens differ from the reference (the fake returns zeros); no call may be refused
        assert report.error is None, report.error
    calls = _attention_calls(fake_npu)
    assert calls, "the attention goes through the fake"
    assert all(b["query"].dtype == torch.bfloat16 for b in calls)
    # (the sparse attention takes its page size from the cache's shape: no block_size)
    assert all(
        b["block_size"] == block
        for b in calls
        if "block_size" in b and b.get("block_table") is not None
    )
    assert _cache_writes(fake_npu), "the cache writes go through the fake too"
    assert _strided_query(calls) == (family in STRIDED_QUERY)
    if mode == "framework":
        # one prefill packing both prompts (T = 19 + 149), one decode step (T = 2) per layer
        assert {_query_tokens(b) for b in calls} == {sum(map(len, PROMPTS)), len(PROMPTS)}


def test_gpt_oss_passes_its_sinks_to_v2(tmp_path, fake_npu):
    _generate(_convert(tmp_path, "gpt_oss", "framework"))
    v2 = fake_npu.of("npu_fused_infer_attention_score_v2")
    assert v2 and all(b["learnable_sink"].dtype == torch.bfloat16 for b in v2)
    assert {b["sparse_mode"] for b in v2} >= {4}, "the sliding layers run as a band"


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear"])
def test_mla_prefill_is_unabsorbed_tnd_and_decode_absorbed(tmp_path, fake_npu, family):
    # Long prompts: the absorbed (512-wide latent) query is for 1..16 tokens per request only,
    # so prefill runs the docs' TND case on keys and values decompressed per head.
    _generate(_convert(tmp_path, family, "framework"))
    calls = _attention_calls(fake_npu)
    prefill = [b for b in calls if b.get("query_rope") is None]
    decode = [b for b in calls if b.get("query_rope") is not None]
    assert prefill and decode
    for b in prefill:
        assert b["input_layout"] == "TND" and b.get("block_table") is None
        assert (b["query"].size(-1), b["key"].size(-1), b["value"].size(-1)) == (192, 192, 128)
        assert b["num_heads"] == b["num_key_value_heads"] == 32
        assert (b["sparse_mode"], b.get("atten_mask") is not None) == (3, True)
        assert b["actual_seq_lengths_kv"] == b["actual_seq_lengths"] == [19, 168]
    for b in decode:
        assert b["query"].size(-1) == 512 and b["num_key_value_heads"] == 1
        assert max(_per_request(b["actual_seq_lengths"])) <= MLA_MAX_QUERY_TOKENS
        assert (b["sparse_mode"], b.get("atten_mask")) == (0, None)


def test_deepseek_v3_with_its_real_128_heads_passes(tmp_path, fake_npu):
    # 128 query heads on one latent head: the MLA case allows it (ratio 128, beyond GQA's 64)
    overrides = {**MLA_MOE, "num_attention_heads": 128, "num_key_value_heads": 128}
    _generate(_convert(tmp_path, "deepseek_v3", "framework", overrides))
    calls = _attention_calls(fake_npu)
    assert {b["num_heads"] for b in calls} == {128}
    assert {b["num_key_value_heads"] for b in calls} == {1, 128}  # decode latent, prefill TND


def test_chunked_mla_prefill_reads_the_earlier_chunks_from_the_cache(tmp_path, fake_npu):
    # A 149-token prompt in chunks of 64: the later chunks' keys are the whole context so far.
    _generate(
        _convert(tmp_path, "deepseek_v3", "framework"),
        prompts=[list(range(1, 150))],
        max_num_batched_tokens=64,
    )
    prefill = [b for b in _attention_calls(fake_npu) if b.get("query_rope") is None]
    per_layer = {
        (tuple(b["actual_seq_lengths"]), tuple(b["actual_seq_lengths_kv"])) for b in prefill
    }
    assert per_layer == {((64,), (64,)), ((64,), (128,)), ((21,), (149,))}
    assert {b["key"].size(0) for b in prefill} == {64, 128, 149}


def _per_request(cumulative: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *cumulative], cumulative, strict=False)]


def test_the_dry_run_rejects_cpu_only_block_sizes_and_float32(tmp_path, fake_npu):
    # the conversion is fine; the runtime settings CPU verify uses are not
    out = _convert(tmp_path, "llama", "framework")
    with pytest.raises(fake_torch_npu.reference.OpInputError, match="multiple of 128 .* got 16"):
        _generate(out, block_size=16)
    with pytest.raises(fake_torch_npu.reference.OpInputError, match="float16 or bfloat16"):
        _generate(out, dtype="float32")


def test_the_binding_rejects_a_keyword_the_schema_lacks(fake_npu):
    import kvskill.runtime.ops as ops

    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(
        fake_torch_npu.BindingError, match="unexpected keyword argument 'softmax_scale'"
    ):
        ops.torch_npu.npu_fused_infer_attention_score(q, q, q, softmax_scale=0.1)
    with pytest.raises(fake_torch_npu.BindingError, match="'actual_seq_lengths' must be SymInt"):
        ops.torch_npu.npu_fused_infer_attention_score(
            q, q, q, input_layout="TND", actual_seq_lengths=torch.tensor([1])
        )
    assert fake_npu.calls == []


def test_absorbed_mla_over_a_whole_prompt_is_refused_as_on_the_npu(fake_npu):
    # What kvskill used to emit for MLA prefill: the 512-wide latent query over a 149-token
    # prompt. The 2.13.0 docs allow it 1..16 tokens per request (npu_ops.md §9).
    import kvskill.runtime.ops as ops

    bf16 = torch.bfloat16
    cache = torch.zeros(2, 1, 512 // 16, BLOCK, 16, dtype=bf16)
    rope_cache = torch.zeros(2, 1, 64 // 16, BLOCK, 16, dtype=bf16)
    with pytest.raises(
        fake_torch_npu.reference.OpInputError, match="1..16 query tokens per request, got 149"
    ):
        ops.torch_npu.npu_fused_infer_attention_score(
            torch.zeros(149, 32, 512, dtype=bf16),
            cache,
            cache,
            query_rope=torch.zeros(149, 32, 64, dtype=bf16),
            key_rope=rope_cache,
            num_heads=32,
            num_key_value_heads=1,
            input_layout="TND_NTD",
            atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
            sparse_mode=3,
            block_table=torch.tensor([[0, 1]], dtype=torch.int32),
            block_size=BLOCK,
            actual_seq_lengths=[149],
            actual_seq_lengths_kv=[149],
        )


def test_unpaged_tnd_outside_the_documented_head_dims_is_refused(fake_npu):
    # The docs' TND case (v1): Q_D = K_D = 192, V_D 128 or 192, Q_N = K_N = V_N in 8..128.
    import kvskill.runtime.ops as ops

    def call(d: int, v: int, heads: int = 32, kv_heads: int = 32):
        q = torch.zeros(20, heads, d, dtype=torch.bfloat16)
        k = torch.zeros(20, kv_heads, d, dtype=torch.bfloat16)
        return ops.torch_npu.npu_fused_infer_attention_score(
            q,
            k,
            torch.zeros(20, kv_heads, v, dtype=torch.bfloat16),
            num_heads=heads,
            num_key_value_heads=kv_heads,
            input_layout="TND",
            atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
            sparse_mode=3,
            actual_seq_lengths=[20],
            actual_seq_lengths_kv=[20],
        )

    out, _ = call(192, 128)
    assert out.shape == (20, 32, 128)
    with pytest.raises(fake_torch_npu.reference.OpInputError, match="Q_D 80, K_D 80, V_D 24"):
        call(80, 24)
    with pytest.raises(fake_torch_npu.reference.OpInputError, match="heads equal and in"):
        call(192, 128, heads=32, kv_heads=8)
