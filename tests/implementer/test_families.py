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


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_next"])
def test_conversion_is_token_exact_on_the_page_pool_layout(converted, family):
    # The same converted code, given strided page views instead of dense caches: its cache
    # write must address (block, offset) pairs, since the views cannot be flattened to slots.
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    report = verify_directory(converted.directory(family), VerifyOptions(kv_layout="page_pool"))
    assert report.kv_layout == "page_pool"
    assert report.error is None, report.error
    assert report.passed, report.failures()


SMALL_QWEN3 = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
}


def test_run_on_the_page_pool_generates_what_the_contiguous_layout_does(tmp_path, capsys):
    import json

    from kvskill.cli import main
    from kvskill.implementer.writer import ApplyOptions, apply_model

    out = tmp_path / "qwen3"
    apply_model("qwen3", out, ApplyOptions(config_overrides=SMALL_QWEN3))
    tokens = {}
    for layout in ("contiguous", "page_pool"):
        with pytest.raises(SystemExit) as exc:
            main(
                ["run", str(out), "--random-weights", "--num-requests", "3", "--prompt-len",
                 "40", "--max-tokens", "6", "--block-size", "16", "--kv-layout", layout,
                 "--format", "json"]
            )  # fmt: skip
        report = json.loads(capsys.readouterr().out)
        assert exc.value.code == 0, report
        tokens[layout] = [r["token_ids"] for r in report["requests"]]
    assert tokens["page_pool"] == tokens["contiguous"]


def test_value_head_dim_and_per_layer_kv_heads_of_mimo_verify(tmp_path):
    # MiMo-V2-Flash: values 128 wide on 192-wide keys (shrunk: 128 on 64), and sliding layers
    # whose __init__ doubles the KV heads in a local. The value cache takes the value head
    # dim; the heads per rank take the layer's own count.
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "mimo"
    apply_model("mimo_v2_flash", out, ApplyOptions())
    source = (out / "modeling_mimo_v2_flash.py").read_text()
    assert "dim=self.v_head_dim," in source
    assert "max(num_key_value_heads // self.attn_tp_size, 1)" in source
    report = verify_directory(out, VerifyOptions())
    assert (
        report.config_changes["head_dim"][1] != report.config_changes.get("v_head_dim", [0, 128])[1]
    )
    assert set(report.config_changes["layer_types"][1]) == {"full_attention", "sliding_attention"}
    assert report.passed, report.failures()


def test_moshi_verifies_with_the_window_its_cache_never_reaches(tmp_path):
    # Moshi's default sliding_window (3000) equals max_position_embeddings: transformers'
    # DynamicCache windows every layer by it, but the window never binds, so the plain
    # causal conversion is exact. verify must not shrink that window below its prompts (the
    # original would then see only the last 8 tokens in decode and all of them in prefill).
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "moshi"
    apply_model("moshi", out, ApplyOptions())
    report = verify_directory(out, VerifyOptions())
    assert "sliding_window" not in report.config_changes
    assert report.passed, report.failures()


def test_prompt_tokens_equal_to_the_pad_id_are_attended_by_the_reference(converted):
    # Seed 2 draws token 0, verify's pad_token_id: without an explicit attention mask
    # transformers' generate masks those prompt tokens out, and the runtime does not.
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions
    from kvskill.verify.prompts import make_prompts

    assert any(0 in p for p in make_prompts([3, 21, 19, 25], 256, seed=2))
    report = verify_directory(converted.directory("qwen3"), VerifyOptions(seed=2))
    assert report.passed, report.failures()


def test_granite_swa_passes_within_float32_resolution_and_a_real_error_fails(tmp_path):
    # granite_swa's tied embeddings and unscaled q.k (attention_multiplier 1.0) give logits
    # near 170, where float32 rounding alone exceeds 1e-4 (LOGIT_RTOL in verify/compare.py); a
    # window off by one must still fail.
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "granite_swa"
    apply_model("granite_swa", out, ApplyOptions())
    report = verify_directory(out, VerifyOptions())
    assert max(p.logit_scale for p in report.prompts) > 100
    assert report.passed, report.failures()
    path = out / "modeling_granite_swa.py"
    text = path.read_text()
    anchor = "config.sliding_window - 1"
    assert text.count(anchor) == 1
    path.write_text(text.replace(anchor, "config.sliding_window"))
    # the edited file is no longer the one kvskill wrote and signed: it runs only when trusted
    mutated = verify_directory(out, VerifyOptions(trust_remote_code=True))
    assert not mutated.passed
    assert not mutated.tokens_identical or not mutated.logits_within


def test_emu3_causal_lm_is_built_from_the_text_config_of_its_composite_config(tmp_path):
    # emu3's config.json is the composite Emu3Config, while Emu3ForCausalLM takes the
    # Emu3TextConfig inside it (as transformers' AutoModelForCausalLM does). Built from the
    # composite it failed ("'Emu3Config' object has no attribute 'pad_token_id'").
    from kvskill.implementer.writer import ApplyOptions, apply_model
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    out = tmp_path / "emu3"
    apply_model("emu3", out, ApplyOptions())
    report = verify_directory(out, VerifyOptions())
    assert report.passed, report.failures()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron_h", "zamba2"])
def test_hybrids_clamping_dt_in_their_scan_only_verify_with_default_configs(converted, family):
    # Their chunked scan clamps dt to time_step_min and their decode step does not: a
    # generated token fed through the scan (riding along with a prompt chunk) moved the
    # logits by up to 0.03. Verify's chunked prefill leaves the short prompts decoding while
    # the long ones are computed, so they would ride along.
    import torch
    from kvskill.verify.drivers.engine import MAX_BATCHED_TOKENS
    from kvskill.verify.flow import verify_directory
    from kvskill.verify.options import VerifyOptions

    report = converted.report(family)
    assert report.error is None, report.error
    assert report.passed, report.failures()
    # the prompts take several prefill steps, the shortest done after the first
    assert sum(p.prompt_len for p in report.prompts) > 2 * MAX_BATCHED_TOKENS
    assert min(p.prompt_len for p in report.prompts) < MAX_BATCHED_TOKENS
    # the original's weights come from verify's seed alone, not the process's generator
    torch.manual_seed(12345)

    again = verify_directory(converted.directory(family), VerifyOptions(trust_remote_code=True))
    assert [p.max_logit_diff for p in again.prompts] == [p.max_logit_diff for p in report.prompts]
    assert [p.reference_tokens for p in again.prompts] == [
        p.reference_tokens for p in report.prompts
    ]
