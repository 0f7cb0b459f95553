"""Verify can fail: each classic KV/FA mistake, planted in a converted file, is reported."""

from __future__ import annotations

import pytest
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions


def _mutate(converted, tmp_path, family: str, file: str, old: str, new: str):
    directory = converted.copy(family, tmp_path / family)
    path = directory / file
    text = path.read_text()
    assert text.count(old) == 1, f"mutation anchor {old!r} not found once in {file}"
    path.write_text(text.replace(old, new))
    return verify_directory(directory, VerifyOptions(trust_remote_code=True))


MUTATIONS = {
    # no causal masking in prefill: the prompt attends to its future
    "prefill_sparse_mode_0": (
        "qwen3",
        "modeling_qwen3.py",
        "sparse_mode=3,",
        "sparse_mode=0 if md.is_prefill else 3,",
    ),
    # pre_tokens = W admits W + 1 keys: one key too many past the window
    "pre_tokens_off_by_one": (
        "mistral",
        "modeling_mistral.py",
        "self.pre_tokens = config.sliding_window - 1",
        "self.pre_tokens = config.sliding_window",
    ),
    # the FA call told twice the KV heads the cache holds
    "num_key_value_heads_doubled": (
        "qwen3",
        "modeling_qwen3.py",
        "num_key_value_heads=self.num_key_value_heads_per_rank,",
        "num_key_value_heads=self.num_key_value_heads_per_rank * 2,",
    ),
    # the YaRN mscale**2 factor dropped from the softmax scale
    "missing_mscale": (
        "tiny_remote",
        "modeling_tiny_remote.py",
        "scale=self.softmax_scale,",
        "scale=self.head_dim**-0.5,",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_verify_reports_the_planted_mistake(converted, tmp_path, name):
    family, file, old, new = MUTATIONS[name]
    # the unmutated conversion passes, so the failure below is the mutation's
    assert converted.report(family).passed
    report = _mutate(converted, tmp_path, family, file, old, new)
    assert not report.passed
    assert report.failures(), "a failed verify lists what failed"
    if report.error is None:
        assert not report.tokens_identical or report.max_logit_diff > report.atol
