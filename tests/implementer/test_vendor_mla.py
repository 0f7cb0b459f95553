"""The DeepSeek-V2/V3 hub shape of latent attention (tests/fixtures/vendor/mla_decompressed_bhsd).

The hub files decompress the latent with ``kv_b_proj`` *before* their cache write and cache
per-head keys and values through the 4.3x cache API; transformers 5's deepseek caches the
latent itself. Both convert through the absorbed MLA path: here the paged caches take the
normalised latent ``kv_b_proj`` reads and the rotated rope key of the down-projection's split.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.core.errors import UnsupportedModelError
from kvskill.implementer.convert import ApplyOptions
from kvskill.implementer.mla import MlaSpec
from kvskill.implementer.pipeline import convert_mla_source
from kvskill.implementer.writer import apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import (  # noqa: E402
    MLA_MODES,
    MLA_VENDOR_FIXTURES,
    VENDOR_ROOT,
    convert_and_verify,
)

FIXTURE = VENDOR_ROOT / "mla_decompressed_bhsd"
MODELING = "modeling_vendor_mla.py"
#: the cache-length statement as the hub files spell it (the fixture reads the length through a
#: helper so that its original also runs where the cache lacks get_usable_length)
HUB_LENGTH = "kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)"
FIXTURE_LENGTH = "kv_seq_len += usable_length(past_key_value, kv_seq_len, self.layer_idx)"


@pytest.fixture(scope="module")
def plan():
    return analyze_model(str(FIXTURE))


@pytest.fixture(scope="module")
def source() -> str:
    return (FIXTURE / MODELING).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def converted(plan, source) -> str:
    return convert_mla_source(source, MlaSpec.from_plan(plan), filename=MODELING)


def test_the_plan_is_absorbed_mla_with_the_yarn_scale_and_interleaved_rope(plan):
    assert plan.attention.value == "mla" and plan.mla_absorb
    assert plan.input_layout.value == "TND_NTD"
    # (16 + 64)^-0.5 * (0.1 * 1.0 * ln 4 + 1)^2, as the fixture's __init__ computes it
    assert plan.softmax_scale == pytest.approx(80**-0.5 * (0.1 * math.log(4) + 1) ** 2)
    assert plan.rope_style == "interleaved"
    assert plan.mla_cache_write == "scatter"
    reason = next(e.reason for e in plan.evidence if e.decision == "mla_cache_write")
    assert "self.kv_b_proj decompresses from the latent before its cache write" in reason


def test_the_latent_and_the_rotated_rope_key_are_cached(converted):
    assert "mla_latent = self.kv_a_layernorm(compressed_kv)" in converted
    assert (
        "self.update_latent_cache(slots, mla_latent.reshape(-1, mla_latent.shape[-1]), "
        "k_pe.reshape(-1, k_pe.shape[-1]))" in converted
    )
    assert "value_states = past_key_value.update(" not in converted
    assert "torch.matmul(query_states, key_states.transpose(2, 3))" not in converted
    assert "scale=self.softmax_scale," in converted
    # the rotary table covers the packed step's positions
    assert "self.rotary_emb(value_states, seq_len=_paged_seq_len(kv_seq_len))" in converted
    assert converted.count("def _paged_seq_len(") == 1


def test_converting_the_converted_file_changes_nothing(plan, converted):
    assert convert_mla_source(converted, MlaSpec.from_plan(plan), filename=MODELING) == converted


def test_the_hub_spelling_of_the_cache_length_converts_the_same(plan, source, converted):
    assert FIXTURE_LENGTH in source
    hub = source.replace(FIXTURE_LENGTH, HUB_LENGTH)
    out = convert_mla_source(hub, MlaSpec.from_plan(plan), filename=MODELING)
    assert out == converted.replace(FIXTURE_LENGTH, HUB_LENGTH)


def test_a_latent_rebound_before_the_cache_write_is_refused(plan, source):
    broken = source.replace(
        "        kv_seq_len = value_states.shape[-2]\n",
        "        kv_seq_len = value_states.shape[-2]\n        compressed_kv = compressed_kv * 2\n",
        1,
    )
    with pytest.raises(UnsupportedModelError) as refused:
        convert_mla_source(broken, MlaSpec.from_plan(plan), filename=MODELING)
    assert "VendorMlaAttention.forward rebinds ['compressed_kv'] between self.kv_b_proj(...)" in (
        str(refused.value)
    )


def test_standalone_mode_1_is_refused_with_the_reason(tmp_path):
    options = ApplyOptions(deploy_mode="standalone", kv_mode="contiguous")
    with pytest.raises(UnsupportedModelError, match="generated over the paged latent caches"):
        apply_model(str(FIXTURE), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MLA_MODES, ids=lambda mode: "-".join(mode))
@pytest.mark.parametrize("name", sorted(MLA_VENDOR_FIXTURES))
def test_mla_vendor_shape_converts_and_verifies_token_exact(name, mode, tmp_path):
    report = convert_and_verify(name, tmp_path / "out", *mode)
    assert report.passed, report.failures()
    assert report.tokens_identical
    assert report.max_logit_diff < 1e-4


@pytest.mark.slow
def test_without_q_lora_rank_the_plain_q_proj_path_verifies_token_exact(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    config = json.loads((model / "config.json").read_text())
    config["q_lora_rank"] = None
    (model / "config.json").write_text(json.dumps(config))
    report = convert_and_verify("", tmp_path / "out", "framework", "paged", model=model)
    assert report.passed, report.failures()
    assert report.max_logit_diff < 1e-4


@pytest.mark.slow
def test_caching_the_rope_key_before_its_rotation_fails_verify(tmp_path):
    """Mutation: the rope part of the split, unrotated, in the rope cache."""
    out = tmp_path / "out"
    apply_model(str(FIXTURE), out, ApplyOptions())
    modeling = out / MODELING
    text = modeling.read_text(encoding="utf-8")
    rotated = "k_pe.reshape(-1, k_pe.shape[-1]))"
    assert rotated in text
    text = text.replace(
        "        mla_latent = self.kv_a_layernorm(compressed_kv)\n",
        "        mla_latent = self.kv_a_layernorm(compressed_kv)\n"
        "        raw_pe = self.kv_a_proj_with_mqa(hidden_states)[..., self.kv_lora_rank :]\n",
    ).replace(rotated, "raw_pe.reshape(-1, raw_pe.shape[-1]))")
    modeling.write_text(text, encoding="utf-8")
    report = verify_directory(out, VerifyOptions(trust_remote_code=True))
    assert not report.passed
