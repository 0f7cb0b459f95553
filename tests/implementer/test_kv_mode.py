"""``--kv-mode`` is honoured or refused in both deploy modes, never ignored."""

from __future__ import annotations

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import BadInputError
from kvskill.implementer.kv_mode import resolve_kv_mode
from kvskill.implementer.writer import ApplyOptions, convert_model

SMALL = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


@pytest.fixture(scope="module")
def plans():
    return {
        (model, mode): analyze_model(model, deploy_mode=mode)
        for model in ("qwen3", "gemma2")
        for mode in ("framework", "standalone")
    }


@pytest.mark.parametrize(
    ("model", "mode", "requested", "written"),
    [
        ("qwen3", "framework", "auto", "paged"),
        ("qwen3", "framework", "paged", "paged"),
        ("qwen3", "framework", "legacy", "legacy"),
        ("gemma2", "framework", "auto", "legacy"),
        ("qwen3", "standalone", "auto", "paged"),
        ("qwen3", "standalone", "legacy", "contiguous"),
        ("qwen3", "standalone", "contiguous", "contiguous"),
        ("gemma2", "standalone", "auto", "contiguous"),
    ],
)
def test_each_value_names_what_the_mode_writes(plans, model, mode, requested, written):
    assert resolve_kv_mode(plans[model, mode], requested) == written


@pytest.mark.parametrize("requested", ["contiguous", "flat"])
def test_a_value_framework_mode_cannot_write_is_bad_input(plans, requested):
    with pytest.raises(BadInputError, match=f"--kv-mode {requested}: framework mode writes"):
        resolve_kv_mode(plans["qwen3", "framework"], requested)


def test_framework_legacy_is_written_asked_or_chosen():
    # asked explicitly of a paged model, and chosen by the Plan for a soft-capping one: both
    # write static-row (Legacy) caches, never the paged seam
    for model, kv_mode in (("qwen3", "legacy"), ("gemma2", "auto")):
        code = convert_model(model, ApplyOptions(kv_mode=kv_mode, config_overrides=SMALL)).converted
        assert 'self.attn_type = "Legacy"' in code and "npu_fused_infer" not in code


@pytest.mark.slow
def test_standalone_legacy_is_mode_one():
    conversion = convert_model(
        "qwen3", ApplyOptions(deploy_mode="standalone", kv_mode="legacy", config_overrides=SMALL)
    )
    assert conversion.standalone is not None and conversion.standalone.mode == 1
    assert "scatter_update_" in conversion.converted
