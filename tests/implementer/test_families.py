"""Every supported family: apply -> verify passes (tokens identical, logits within 1e-4)."""

from __future__ import annotations

import pytest
from conftest import FAMILIES, REMOTE


@pytest.mark.parametrize("family", [*FAMILIES, REMOTE])
def test_apply_then_verify_is_token_exact(converted, family):
    report = converted.report(family)
    assert report.error is None, report.error
    assert report.tokens_identical, report.failures()
    assert report.max_logit_diff <= 1e-4
    # the three chains ran and held
    assert [c["name"] for c in report.chains] == ["init", "runtime", "release"]
    assert all(c["passed"] for c in report.chains), report.failures()
    # prompts of several lengths, some longer than several blocks
    lengths = [p.prompt_len for p in report.prompts]
    assert len(set(lengths)) == len(lengths)
    assert max(lengths) > 4 * report.block_size
    assert report.passed


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_windowed_families_run_prompts_past_the_window(converted, family):
    report = converted.report(family)
    window = report.config_changes["sliding_window"][1]
    assert max(p.prompt_len for p in report.prompts) > window
    assert report.passed


def test_gpt_oss_keeps_its_layer_pattern_and_sinks(converted):
    source = (converted.directory("gpt_oss") / "modeling_gpt_oss.py").read_text()
    assert "npu_fused_infer_attention_score_v2(" in source
    assert "learnable_sink=self.sinks" in source
    assert (
        'self.attn_type = "FullAttention" if config.layer_types[layer_idx] == "full_attention" '
        'else "SlidingWindow"' in source
    )
    assert (
        'self.pre_tokens = 2147483647 if self.attn_type == "FullAttention" else config.sliding_window - 1'
        in source
    )
    layers = converted.report("gpt_oss").config_changes["layer_types"][1]
    assert layers == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_conversion_is_token_exact_on_the_page_pool_layout(converted, family):
    # The same converted code, given strided page views instead of dense caches: its cache
    # write must address (block, offset) pairs, since the views cannot be flattened to slots.
    from kvskill.implementer.verify import VerifyOptions, verify_directory

    report = verify_directory(converted.directory(family), VerifyOptions(kv_layout="page_pool"))
    assert report.kv_layout == "page_pool"
    assert report.error is None, report.error
    assert report.passed, report.failures()
