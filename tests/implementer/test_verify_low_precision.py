"""float16 / bfloat16 verify: rounding alone passes, a planted conversion error fails.

The verdict (``implementer/verdict.py``) measures the converted model's drift from the
float32 original against the original's own drift in the same dtype.
"""

from __future__ import annotations

import pytest
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.table import format_table
from kvskill.verify.verdict import DRIFT_RATIO

#: where the converted qwen3_moe attention flattens K and V to TND, and its scale
KEY_TND = "key_tnd = key_states.transpose(1, 2)"
VALUE_TND = "value_tnd = value_states.transpose(1, 2)"
SCALE = "scale=self.scaling,"


def _planted(converted, tmp_path, edits: list[tuple[str, str]]):
    directory = converted.copy("qwen3_moe", tmp_path / "qwen3_moe")
    path = directory / "modeling_qwen3_moe.py"
    text = path.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"mutation anchor {old!r} not found once"
        text = text.replace(old, new)
    path.write_text(text)
    return directory


def _bf16(directory, seed: int = 0):
    # an edited file is no longer kvskill's own code: it runs only when trusted
    options = VerifyOptions(dtype="bfloat16", seed=seed, trust_remote_code=True)
    return verify_directory(directory, options)


@pytest.mark.parametrize(
    ("family", "seed"), [("qwen3_moe", s) for s in range(5)] + [("mixtral", s) for s in range(4)]
)
def test_rounding_alone_passes_a_plain_moe_model_in_bfloat16(converted, family, seed):
    report = _bf16(converted.directory(family), seed)
    verdict = report.low_precision
    assert verdict is not None
    assert report.passed, report.failures()
    assert verdict.noise_floor > 1e-3, "bfloat16 rounding is measured, not assumed"
    assert verdict.ratio < DRIFT_RATIO
    table = format_table(report)
    assert "bfloat16 drift from the float32 original" in table and "ratio" in table
    # each row names its reference, so "differ at step 0" beside PASSED reads as rounding
    header = next(line for line in table.splitlines() if line.startswith("prompt "))
    assert "greedy tokens vs float32 original" in header
    assert "max |logit diff| vs float32 original" in header
    assert "the converted model in bfloat16 against the float32 original" in table


def test_a_router_flip_in_the_converted_run_alone_is_rounding(converted):
    # issue 28's case: a fixed bf16 tolerance failed a correct conversion at 0.656. One step
    # of the converted run moves far (an expert picked on a near tie), the original's run
    # does not; every other step drifts as the original's does. Which seed flips depends on
    # the transformers version (mixtral seed 1 under 5.24.0: 0.674 against 0.021).
    for seed in range(4):
        report = _bf16(converted.directory("mixtral"), seed)
        verdict = report.low_precision
        if verdict.converted.max > 10 * verdict.noise_floor > verdict.original.max:
            assert report.passed, report.failures()
            return
    pytest.skip("no converted-only router flip on mixtral seeds 0-3 here")


def test_swapped_kv_heads_fail_the_bfloat16_verdict(converted, tmp_path):
    flip = [
        (KEY_TND, KEY_TND.replace("key_states.", "key_states.flip(1).")),
        (VALUE_TND, VALUE_TND.replace("value_states.", "value_states.flip(1).")),
    ]
    report = _bf16(_planted(converted, tmp_path, flip))
    verdict = report.low_precision
    assert not report.passed
    assert verdict.ratio > 10 * DRIFT_RATIO
    assert "more than rounding" in report.failures()[0]
    assert report.to_dict()["low_precision"]["passed"] is False


def test_a_softmax_scale_five_percent_off_fails_the_bfloat16_verdict(converted, tmp_path):
    report = _bf16(_planted(converted, tmp_path, [(SCALE, "scale=self.scaling * 1.05,")]))
    verdict = report.low_precision
    assert not report.passed
    # a 5% error moves logits by about the bf16 rounding itself: caught by the ratio
    assert DRIFT_RATIO < verdict.ratio < 10
    assert verdict.tokens_ok, "no token test would have caught it"


def test_float32_keeps_the_exact_check(converted):
    report = converted.report("qwen3_moe")
    assert report.low_precision is None and report.passed
    assert report.max_logit_diff <= report.atol + report.rtol * 100
