"""Dry runs of converted families against a stand-in torch_npu that checks what the real one would.

Every operator call binds against torch_npu 2.13.0's schema and passes the documented limits
under the strict NPU profile (bf16, block size 128, head dims the device takes), or the run
fails: a conversion that verifies on the CPU reference but that the NPU would reject shows up
here. Outputs are zeros, so only the calls are checked, not the numerics.
"""

from __future__ import annotations

from pathlib import Path

import fake_torch_npu
import pytest
import torch
from kvskill.implementer.verify import VerifyOptions, verify_directory
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime import LLM, SamplingParams

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
FAMILIES = {
    # GQA, full attention
    "llama": DENSE,
    "qwen2": DENSE,
    "qwen3": DENSE,
    # GQA with mixture-of-experts MLPs
    "qwen3_moe": {
        **DENSE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    },
    "mixtral": {**DENSE, "num_local_experts": 4, "num_experts_per_tok": 2},
    # sliding window on every layer, smaller than the longer prompt
    "mistral": {**DENSE, "sliding_window": 64},
    # learnable sinks (FA v2), sliding and full layers
    "gpt_oss": {
        **DENSE,
        "sliding_window": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # gated delta net layers (Mamba group) before a full-attention layer
    "qwen3_next": {
        **DENSE,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
}
#: MLA with the 512 + 64 latent the absorbed operator path requires
MLA = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "vocab_size": 512,
}
#: a prompt inside one block and one spanning two, so prefill packs both and decode follows
PROMPTS = [list(range(1, 20)), list(range(1, 150))]


@pytest.fixture
def fake_npu(monkeypatch):
    log = fake_torch_npu.CallLog()
    fake_torch_npu.install(monkeypatch, log)
    return log


def _convert(tmp_path: Path, family: str, overrides: dict, mode: str) -> Path:
    out = tmp_path / f"{family}-{mode}"
    options = ApplyOptions(deploy_mode=mode, config_overrides=overrides)
    apply_model(family, out, options)
    return out


def _generate(
    directory: Path, *, dtype: str = "bfloat16", block_size: int = BLOCK, prompts=PROMPTS
):
    llm = LLM(
        directory,
        random_weights=True,
        dtype=dtype,
        device="cpu",
        block_size=block_size,
        num_blocks=8 * BLOCK // block_size,
        freeze_startup_heap=False,
    )
    return llm.generate(prompts, SamplingParams(max_tokens=2))


def _attention_calls(log: fake_torch_npu.CallLog) -> list[dict]:
    return log.of("npu_fused_infer_attention_score") + log.of("npu_fused_infer_attention_score_v2")


def _query_tokens(bound: dict) -> int:
    return bound["query"].size(0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_framework_conversion_makes_only_calls_the_npu_accepts(tmp_path, fake_npu, family):
    out = _convert(tmp_path, family, FAMILIES[family], "framework")
    results = _generate(out)
    assert [len(r.token_ids) for r in results] == [2, 2]
    calls = _attention_calls(fake_npu)
    # one prefill packing both prompts (T = 19 + 149) and one decode step (T = 2) per layer
    assert {_query_tokens(b) for b in calls} == {sum(map(len, PROMPTS)), len(PROMPTS)}
    assert all(b["block_size"] == BLOCK and b["query"].dtype == torch.bfloat16 for b in calls)
    assert fake_npu.of("npu_scatter_nd_update_"), "the cache writes go through the fake too"


def test_gpt_oss_passes_its_sinks_to_v2(tmp_path, fake_npu):
    _generate(_convert(tmp_path, "gpt_oss", FAMILIES["gpt_oss"], "framework"))
    v2 = fake_npu.of("npu_fused_infer_attention_score_v2")
    assert v2 and all(b["learnable_sink"].dtype == torch.bfloat16 for b in v2)
    assert {b["sparse_mode"] for b in v2} >= {4}, "the sliding layers run as a band"


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_oss"])
def test_standalone_conversion_makes_only_calls_the_npu_accepts(tmp_path, fake_npu, family):
    out = _convert(tmp_path, family, FAMILIES[family], "standalone")
    options = VerifyOptions(
        shrink=False, block_size=BLOCK, dtype="bfloat16", num_prompts=2, max_new_tokens=2
    )
    report = verify_directory(out, options)
    # tokens differ from the reference (the fake returns zeros); no call may be refused
    assert report.error is None, report.error
    assert _attention_calls(fake_npu)


def test_the_dry_run_rejects_cpu_only_block_sizes_and_float32(tmp_path, fake_npu):
    # the conversion is fine; the runtime settings CPU verify uses are not
    out = _convert(tmp_path, "llama", FAMILIES["llama"], "framework")
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


def test_absorbed_mla_prefill_of_long_prompts_is_refused_as_on_the_npu(tmp_path, fake_npu):
    # Known gap: kvskill runs absorbed MLA (a 512-wide latent query) over whole prompts; the
    # 2.13.0 docs allow that query 1..16 tokens per request (npu_ops.md §9). When the converted
    # MLA prefill stops absorbing, this must become an acceptance test like the ones above.
    out = _convert(tmp_path, "deepseek_v3", MLA, "framework")
    with pytest.raises(
        fake_torch_npu.reference.OpInputError, match="1..16 query tokens per request, got 149"
    ):
        _generate(out)


def test_mla_conversion_is_accepted_while_prompts_stay_within_16_tokens(tmp_path, fake_npu):
    # Everything else of the absorbed MLA call passes: latent 512 + rope 64, one KV head,
    # 32 query heads, block 128, sparse 3 prefill / 0 decode.
    out = _convert(tmp_path, "deepseek_v3", MLA, "framework")
    results = _generate(out, prompts=[list(range(1, 6)), list(range(1, 17))])
    assert [len(r.token_ids) for r in results] == [2, 2]
    calls = _attention_calls(fake_npu)
    assert {b["query"].size(-1) for b in calls} == {512}
    assert {b["sparse_mode"] for b in calls} == {0, 3}
