"""The low-precision verdict on hand-made runs: what rounding looks like, and what it is not."""

from __future__ import annotations

import math

import torch
from kvskill.verify.verdict import DRIFT_RATIO, TOP_K, Generation, judge, measure

VOCAB = 32
STEPS = 8


def _run(tokens: list[int], noise: float, seed: int, offset: float = 0.0) -> Generation:
    """Greedy TOKENS whose logits are the anchor's plus uniform noise of size NOISE."""
    generator = torch.Generator().manual_seed(seed)
    logits = []
    for token in tokens:
        base = torch.arange(VOCAB, dtype=torch.float32) / VOCAB  # token 31 best
        base[token] = 3.0
        jitter = (torch.rand(VOCAB, generator=generator) * 2 - 1) * noise
        logits.append(base + jitter + offset * torch.linspace(-1, 1, VOCAB))
    return Generation(tokens=list(tokens), logits=logits)


def _prompts(noise: float, seed: int, offset: float = 0.0) -> list[Generation]:
    return [_run([p + s for s in range(STEPS)], noise, seed * 10 + p, offset) for p in range(4)]


def test_rounding_alone_passes_with_the_ratio_near_one():
    anchor = _prompts(0.0, 0)
    verdict = judge("bfloat16", anchor, _prompts(0.02, 1), _prompts(0.02, 2))
    assert verdict.passed, verdict.failures()
    assert 0.7 < verdict.ratio < 1.3
    assert verdict.noise_floor > 0.01 and verdict.floor < 1e-3
    assert "ratio" in verdict.summary() and "tokens identical" in verdict.summary()


def test_a_shift_of_every_step_fails_as_more_than_rounding():
    anchor = _prompts(0.0, 0)
    verdict = judge("bfloat16", anchor, _prompts(0.02, 1), _prompts(0.02, 2, offset=0.06))
    assert not verdict.passed
    assert verdict.ratio > DRIFT_RATIO
    assert "more than rounding" in verdict.failures()[0]


def test_one_outlying_step_in_the_converted_run_alone_is_rounding():
    # an MoE router flipping on a near tie in one run and not the other: one step moves far
    anchor = _prompts(0.0, 0)
    converted = _prompts(0.02, 2)
    converted[1].logits[3][5] += 0.9
    verdict = judge("bfloat16", anchor, _prompts(0.02, 1), converted)
    assert verdict.converted.max > 0.85
    steps = verdict.converted.step_drifts
    assert sum(steps) / len(steps) > verdict.allowed, "a plain mean would fail it"
    assert verdict.passed, verdict.failures()


def test_a_divergence_is_judged_by_the_top_k_of_both_runs():
    anchor = _prompts(0.0, 0)
    original = _prompts(0.02, 1)
    near = _prompts(0.02, 2)
    # step 2 of prompt 0: the converted run picks the anchor's second best (token 31)
    near[0].tokens[2:] = [31] * (STEPS - 2)
    verdict = judge("bfloat16", anchor, original, near)
    (divergence,) = verdict.tokens
    assert (divergence.prompt, divergence.step, divergence.token) == (0, 2, 31)
    assert divergence.within_top_k and verdict.passed, verdict.failures()
    far = _prompts(0.02, 2)
    far[0].tokens[2:] = [0] * (STEPS - 2)  # the anchor's worst token
    verdict = judge("bfloat16", anchor, original, far)
    assert not verdict.passed
    assert verdict.tokens[0].rank_in_reference >= TOP_K
    assert any("top-5" in line for line in verdict.failures())


def test_a_step_without_logits_cannot_pass():
    anchor = _prompts(0.0, 0)
    converted = _prompts(0.0, 0)
    converted[2] = Generation(tokens=converted[2].tokens, logits=converted[2].logits[:3])
    verdict = judge("float16", anchor, _prompts(0.01, 1), converted)
    assert math.isinf(verdict.drift) and not verdict.passed
    assert verdict.failures()


def test_drift_is_compared_up_to_the_first_divergence_from_the_anchor():
    anchor = _prompts(0.0, 0)
    side = _prompts(0.0, 0)
    side[0].tokens[4:] = [31] * (STEPS - 4)
    for step in range(5, STEPS):  # after the divergence the runs are not comparable
        side[0].logits[step] = side[0].logits[step] + 100
    drift = measure(anchor, side)
    assert len(drift.step_drifts) == 4 * STEPS - (STEPS - 5)
    assert drift.max < 1e-6
    assert [(d.prompt, d.step) for d in drift.divergences] == [(0, 4)]


def test_where_the_original_left_the_anchor_the_converted_token_is_judged_by_the_anchor():
    # a sparse top-k attention in bf16: at step 2 of prompt 0 both runs leave the float32
    # tokens, each for another token of the anchor's top-5, ranked apart in each other's run
    anchor = _prompts(0.0, 0)
    original = _prompts(0.02, 1)
    original[0].tokens[2:] = [31] * (STEPS - 2)  # the anchor's second best
    original[0].logits[2][31] = 3.5
    converted = _prompts(0.02, 2)
    converted[0].tokens[2:] = [28] * (STEPS - 2)  # the anchor's fifth best
    converted[0].logits[2][28] = 3.5
    for token in (25, 26, 27):  # the original's choice falls to rank 5 here, the anchor's to 4
        converted[0].logits[2][token] = 3.4
    verdict = judge("bfloat16", anchor, original, converted)
    (divergence,) = verdict.tokens
    assert not divergence.within_top_k
    assert verdict.converted.divergences[0].within_top_k
    assert verdict.passed, verdict.failures()
    assert "left the float32 original's tokens at step 2" in verdict.excuses()[0]
    # the same converted token where the original stayed on the anchor's path and ranks it
    # outside its top-5 fails: there the original is the reference
    stayed = _prompts(0.02, 1)
    for token in (25, 26, 27, 29, 30):
        stayed[0].logits[2][token] = 2.9
    verdict = judge("bfloat16", anchor, stayed, converted)
    assert not verdict.passed and not verdict.excuses()
    assert any("top-5" in line for line in verdict.failures())
    # a converted token outside the anchor's top-5 fails where the original's stayed in it
    far = _prompts(0.02, 2)
    far[0].tokens[2:] = [0] * (STEPS - 2)
    far[0].logits[2][0] = 3.5
    verdict = judge("bfloat16", anchor, original, far)
    assert not verdict.passed
    assert any("top-5" in line for line in verdict.failures())
    # and passes where the original itself went as far (the anchor's 7th best, token 26)
    wide = _prompts(0.02, 1)
    wide[0].tokens[2:] = [26] * (STEPS - 2)
    wide[0].logits[2][26] = 3.5
    near_far = _prompts(0.02, 2)
    near_far[0].tokens[2:] = [27] * (STEPS - 2)  # the anchor's 6th best
    near_far[0].logits[2][27] = 3.5  # the original's token is 6th here, as 27 is there
    verdict = judge("bfloat16", anchor, wide, near_far)
    assert not verdict.converted.divergences[0].within_top_k
    assert verdict.passed, verdict.failures()
    assert "no further than the original" in verdict.excuses()[0]


def test_both_sides_are_measured_on_the_same_steps():
    # the converted run leaves the anchor's tokens early in a quiet prompt, the original not:
    # the original's extra quiet steps must not lower its noise floor
    anchor = _prompts(0.0, 0)
    original = _prompts(0.02, 1)
    converted = _prompts(0.02, 2)
    for side in (original, converted):
        for prompt in (1, 2, 3):
            for step in range(STEPS):
                side[prompt].logits[step] = side[prompt].logits[step] + 0.5 * (step % 2)
    converted[0].tokens[1:] = [31] * (STEPS - 1)
    verdict = judge("bfloat16", anchor, original, converted)
    assert len(verdict.original.step_drifts) == len(verdict.converted.step_drifts)
    assert len(verdict.original.step_drifts) == 2 + 3 * STEPS
    assert 0.7 < verdict.ratio < 1.3 and verdict.passed, verdict.failures()
