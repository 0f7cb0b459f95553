"""The Plan names a model's MTP layers, their caches and what speculative decoding costs."""

from __future__ import annotations

import json

from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan import CacheEntryPlan, MtpPlan, Plan


def test_deepseek_v3_mtp_layers_are_planned_after_the_decoder_layers():
    plan = analyze_model(
        "deepseek_v3", config_overrides={"num_hidden_layers": 3, "num_nextn_predict_layers": 2}
    )
    mtp = plan.mtp
    assert isinstance(mtp, MtpPlan)
    assert mtp.num_layers == 2 and mtp.config_key == "num_nextn_predict_layers"
    assert mtp.layer_indices == [3, 4]
    assert mtp.weight_prefixes == ["model.layers.3.", "model.layers.4."]
    # an MTP layer declares what a main full-attention layer declares: the MLA latent pair
    assert [e.cache_name for e in mtp.cache_entries] == ["nope_cache", "rope_cache"]
    per_layer = plan.kv_bytes_per_token // 3
    assert mtp.bytes_per_token == 2 * per_layer
    assert mtp.kv_bytes_per_token_speculative == plan.kv_bytes_per_token + 2 * per_layer
    assert mtp.next_n == 2 and mtp.speculative_refusal is None
    assert "merge" in mtp.merge
    # and it reads back typed from the plan file
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.mtp == mtp and isinstance(again.mtp.cache_entries[0], CacheEntryPlan)


def test_mtp_layers_of_a_model_with_state_layers_are_not_speculative():
    plan = analyze_model("bailing_hybrid")
    assert plan.mtp is not None and plan.mtp.num_layers >= 1
    assert plan.mtp.speculative_refusal is not None
    assert "besides full attention" in plan.mtp.speculative_refusal


def test_mtp_layers_of_a_gated_delta_hybrid_are_speculative(tmp_path):
    from transformers import AutoConfig

    # Qwen3-Next's config.json counts its MTP layers with a key its config class lacks
    config = AutoConfig.for_model("qwen3_next", num_hidden_layers=4, mtp_num_hidden_layers=1)
    config.save_pretrained(tmp_path)
    plan = analyze_model(str(tmp_path))
    assert plan.mtp is not None and plan.mtp.config_key == "mtp_num_hidden_layers"
    assert plan.mtp.speculative_refusal is None
