"""verify's per-prompt comparison: exact tokens, near ties in low precision, real mismatches."""

from __future__ import annotations

import torch
from kvskill.verify.compare import compare_prompt
from kvskill.verify.prompts import choose_prompt_lengths


def _case(ref_tokens, run_tokens, ref_logits, run_logits, atol):
    return compare_prompt(
        0, [1, 2], ref_tokens, torch.stack(ref_logits), run_tokens, run_logits, atol
    )


def test_identical_tokens_report_the_largest_logit_difference():
    ref = [torch.tensor([0.0, 2.0, 1.0]), torch.tensor([3.0, 0.0, 0.0])]
    run = [torch.tensor([0.0, 2.0, 1.00005]), torch.tensor([3.0, 0.0, 0.0])]
    result = _case([1, 0], [1, 0], ref, run, atol=1e-4)
    assert result.passed_tokens and not result.near_tie
    assert abs(result.max_logit_diff - 5e-5) < 1e-6


def test_a_flip_between_tokens_scored_within_atol_is_a_near_tie():
    # the reference scores tokens 1 and 2 within 0.01; bf16 rounding picked 2
    ref = [torch.tensor([0.0, 2.0, 1.995])]
    run = [torch.tensor([0.0, 1.99, 2.0])]
    result = _case([1, 5], [2, 7], ref, run, atol=5e-2)
    assert result.first_mismatch == 0 and result.near_tie and result.passed_tokens


def test_a_flip_between_well_separated_tokens_is_a_mismatch():
    ref = [torch.tensor([0.0, 2.0, 1.0])]
    run = [torch.tensor([0.0, 1.0, 2.0])]
    result = _case([1], [2], ref, run, atol=1e-4)
    assert result.first_mismatch == 0 and not result.near_tie and not result.passed_tokens
    assert result.max_logit_diff == 1.0


def test_prompt_lengths_span_blocks_and_the_window():
    lengths = choose_prompt_lengths(4, block_size=4, window=8, limit=1000)
    assert lengths == [3, 21, 19, 33]
    assert len(set(lengths)) == 4 and max(lengths) > 8 and max(lengths) > 4 * 4
    assert max(choose_prompt_lengths(6, block_size=4, window=None, limit=10)) <= 10


def _report_with(max_logit_diff: float, logit_scale: float, rtol: float | None = None):
    from kvskill.verify.compare import LOGIT_RTOL, PromptResult
    from kvskill.verify.report import VerifyReport

    prompt = PromptResult(
        index=0,
        prompt_len=21,
        reference_tokens=[1],
        runtime_tokens=[1],
        max_logit_diff=max_logit_diff,
        first_mismatch=None,
        logit_scale=logit_scale,
    )
    report = VerifyReport(
        model_type="m",
        directory="d",
        shrunk=True,
        config_changes={},
        dtype="float32",
        atol=1e-4,
        block_size=4,
        rtol=LOGIT_RTOL if rtol is None else rtol,
    )
    report.prompts.append(prompt)
    return report


def test_logit_tolerance_grows_with_the_float32_spacing_of_the_largest_logit():
    # granite_swa: 1.8e-4 apart at logits near 172 is 12 float32 ulps (one ulp 1.5e-5 there)
    assert _report_with(1.8e-4, logit_scale=172.0).logits_within
    # the same difference on logits of order 1 is 1000 ulps: a real error
    assert not _report_with(1.8e-4, logit_scale=1.0).logits_within
    # an error that changes logits (window off by one, wrong scale) is caught at any scale
    assert not _report_with(1e-2, logit_scale=172.0).logits_within
    # rtol 0 is the plain absolute check
    report = _report_with(1.8e-4, logit_scale=172.0, rtol=0.0)
    assert not report.logits_within
    assert "logits differ by 0.00018 > 0.0001" in report.failures()[0]
