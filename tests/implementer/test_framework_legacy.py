"""The framework's own Legacy GQA attention converted to its Paged contract, and proven.

The fixture (tests/fixtures/cann_legacy/gqa_dense) has the shape of cann-recipes-infer's
Legacy attention: ``cache_unit`` rows from ``init_cache``, ``scatter_update_`` at ``kv_len``,
BSH fused attention after packing the TND tokens. ``apply`` rewrites it in place (KVR020,
KVR021); ``verify`` runs the result paged against the fixture's own Legacy path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from kvskill.analyzer.analyze import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions, convert_framework
from kvskill.implementer.pipeline import convert_framework_legacy_source
from kvskill.implementer.spec import ConversionSpec, FaVersion

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cann_legacy" / "gqa_dense"
SOURCE = (FIXTURE / "modeling_legacy_gqa.py").read_text(encoding="utf-8")
SPEC = ConversionSpec(
    fa_version=FaVersion.V1,
    input_layout="TND",
    uniform_attn_type="FullAttention",
    sparse_mode={"FullAttention": {"prefill": 3, "decode": 3}},
)


def convert(source: str) -> str:
    return convert_framework_legacy_source(source, SPEC, filename="modeling_legacy_gqa.py")


def test_the_plan_reads_the_legacy_path_and_apply_takes_the_framework_legacy_path():
    plan = analyze_model(str(FIXTURE))
    assert plan.code["legacy_framework"] is True
    assert plan.code["legacy_framework_source"].startswith("modeling_legacy_gqa.py:")
    converted = convert_framework(plan, ApplyOptions()).converted
    assert "self.cache_entries = [" in converted


def test_the_conversion_replaces_every_legacy_piece_by_the_paged_contract():
    converted = convert(SOURCE)
    # cache_unit -> CacheEntry k/v, needs_block, setters; init_cache -> get_cache_info
    assert "self.cache_unit" not in converted and "def init_cache" not in converted
    assert converted.count("CacheEntry(") == 2 and "needs_block=True" in converted
    assert "def set_k_cache(self, tensor" in converted and "def get_cache_info(self)" in converted
    assert "self.block_size = infer_config.scheduler_config.block_size" in converted
    # scatter_update_ at kv_len -> npu_scatter_nd_update_ at slot_mapping[self.attn_type]
    assert "scatter_update_(" not in converted.replace("npu_scatter_nd_update_(", "")
    assert "slots = md.slot_mapping[self.attn_type].view(-1, 1)" in converted
    assert converted.count("torch_npu.npu_scatter_nd_update_(") == 2
    # BSH FA -> one TND FA over the block table with the executor's length fields (lists)
    assert converted.count("npu_fused_infer_attention_score(") == 1
    assert 'input_layout="TND"' in converted and '"BSH"' not in converted
    assert "block_table=md.block_table[self.attn_type]" in converted
    assert (
        "actual_seq_lengths=(md.actual_seq_lengths_cu_list_q or md.actual_seq_lengths_cu_q.tolist())"
        in converted
    )
    assert "scale=self.scale_fa" in converted
    # the TND <-> BSH packing and what only it used are gone
    for gone in ("index_copy_", "pack_tnd_to_bsh", "flat_idx", "active_k_cache", "scatter_kv_len"):
        assert gone not in converted, gone
    assert "bsz, q_len = 1, total_tokens" in converted
    # the file keeps the executor's imports; nothing of kvskill leaks into it
    assert "from executor.core.kv_cache import" in converted
    assert "from kvskill" not in converted and "import kvskill" not in converted


def _refusal(source: str) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        convert(source)
    return str(info.value)


def test_a_quantized_or_biased_fused_attention_is_refused_with_class_and_line():
    source = SOURCE.replace("next_tokens=0,", "next_tokens=0,\n                pse_shift=None,")
    message = _refusal(source)
    assert "LegacyGqaAttention.forward line " in message
    assert "pse_shift=None" in message and "does not carry over" in message


def test_an_init_cache_allocating_other_states_is_refused_with_its_line():
    source = SOURCE.replace(
        "            layer.self_attn.v_cache = torch.empty(shape, dtype=dtype, device=device)\n",
        "            layer.self_attn.v_cache = torch.empty(shape, dtype=dtype, device=device)\n"
        "            layer.mlp.conv_state = torch.zeros((batch_size, 4))\n",
    )
    message = _refusal(source)
    # a per-row state no layer class holds (sets to None for init_cache to fill)
    assert "init_cache (line " in message and "allocates conv_state on layer.mlp" in message
    assert "not exactly one class sets them all to None" in message


def test_a_legacy_attention_without_the_packing_is_refused_not_half_converted():
    source = SOURCE.replace("packed.index_copy_(0, flat_idx,", "packed.index_put_((flat_idx,),")
    message = _refusal(source)
    assert "LegacyGqaAttention.forward (line " in message
    assert "no TND -> BSH packing" in message


def test_a_windowed_legacy_call_is_refused():
    message = _refusal(SOURCE.replace("sparse_mode=3,", "sparse_mode=4,"))
    assert "sparse_mode=4 is not causal full attention" in message


@pytest.mark.slow
def test_apply_then_verify_is_token_exact_against_the_legacy_original(tmp_path):
    from kvskill.implementer.writer import apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "out"
    apply_model(str(FIXTURE), out, ApplyOptions())
    report = verify_directory(out, VerifyOptions(trust_remote_code=True, max_new_tokens=8))
    assert report.error is None
    assert report.tokens_identical and report.logits_within
    assert report.max_logit_diff < 1e-4
    assert [c["passed"] for c in report.chains] == [True, True, True]
    assert any("Legacy rows allocated by the worker: [4, 19, 32]" in n for n in report.notes)


@pytest.mark.slow
def test_verify_fails_a_conversion_whose_paged_attention_is_wrong(tmp_path):
    """The comparison can fail: a scale 10% off in the paged call moves the logits."""
    from kvskill.implementer.writer import apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "out"
    apply_model(str(FIXTURE), out, ApplyOptions())
    modeling = out / "modeling_legacy_gqa.py"
    text = modeling.read_text(encoding="utf-8")
    assert "scale=self.scale_fa," in text
    modeling.write_text(text.replace("scale=self.scale_fa,", "scale=self.scale_fa * 1.1,"))
    report = verify_directory(out, VerifyOptions(trust_remote_code=True, max_new_tokens=8))
    assert not report.logits_within


ROOT = os.environ.get("KVSKILL_CANN_RECIPES")


#: the real qwen3_5 shrunk: three gated-delta layers, one full-attention layer, tiny MoE
QWEN3_5_SHRUNK = {
    "model_type": "qwen3_5_moe_text",
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}


@pytest.mark.skipif(not ROOT, reason="KVSKILL_CANN_RECIPES is not set")
def test_the_real_qwen3_5_converts_its_attention_and_its_gated_delta_states(tmp_path):
    """The real models/qwen3_5 (shrunk config): its attention is read with no problem and
    apply converts the whole file, the gated-delta states included (KVR020-022)."""
    import json

    import libcst as cst
    from kvskill.implementer.framework_legacy_facts import gather_legacy_attention

    real = Path(ROOT) / "models" / "qwen3_5" / "models"
    for name in ("modeling_qwen3_5_moe.py", "configuration_qwen3_5_moe.py"):
        shutil.copy(real / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_SHRUNK))
    source = (tmp_path / "modeling_qwen3_5_moe.py").read_text(encoding="utf-8")
    [facts] = gather_legacy_attention(cst.parse_module(source))
    assert facts.name == "Qwen3_5MoeAttention" and facts.problems == []
    converted = convert_framework(analyze_model(str(tmp_path)), ApplyOptions()).converted
    assert "def init_cache" not in converted and "def get_cache_info(self)" in converted
    assert converted.count("MambaCacheEntry(") == 2 and converted.count("CacheEntry(") == 4
    # the decode kernel reads the paged states at the step's blocks
    assert "ssm_state_indices=state_index.to(torch.int32)," in converted
    assert "ssm_state_indices=self.gdn_ssm_state_indices" not in converted
