"""The output head's bf16 screen: its rounding bound holds (and is tight on worst-case data),
every screened token is the exact argmax of the fp32 dot products even where bf16 alone picks
another, and the engine screens only greedy steps that no hook records."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.core.errors import BadInputError  # noqa: E402
from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from kvskill.runtime.screened_head import (  # noqa: E402
    BF16_UNIT_ROUNDOFF,
    ScreenedHead,
    error_coefficient,
    unavailable_reason,
)
from toy_factory import toy_prompts, write_toy_dir  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

U = BF16_UNIT_ROUNDOFF


def _head(weight: torch.Tensor) -> nn.Linear:
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


def _fp32_dots(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Every logit as the screen computes its candidates' (one fp32 dot product each)."""
    return (x.unsqueeze(1) * weight.unsqueeze(0)).sum(dim=-1)


@pytest.mark.parametrize("n", [256, 1024, 4096])  # 4096: oneDNN may split the sum into parts
def test_the_bound_covers_inputs_that_round_the_same_way_in_every_product_and_is_tight(n):
    # Every x_i and w_i sits just below 1 + u, so bf16 rounds each down to 1: each product
    # loses almost (2u + u^2) of itself, all with one sign, and |x||w| = sum|x_i w_i|. The GEMM
    # output (n, a power of two) is exact in bf16, so the coefficient c alone must cover the
    # error.
    value = 1 + U - 2.0**-20
    x = torch.full((1, n), value)
    weight = torch.full((8, n), value)
    screen = ScreenedHead(_head(weight))
    approx = torch.ops.mkldnn._linear_pointwise(
        x.to(torch.bfloat16), screen.packed_bf16, None, "none", [], ""
    ).float()
    assert torch.equal(approx, torch.full((1, 8), float(n)))
    error = (_fp32_dots(x, weight) - approx).abs().max().item()
    bound = error_coefficient(n) * x.norm().item() * screen.max_row_norm
    assert error <= bound
    # The rounding term alone is nearly reached: a bf16 roundoff taken as 2**-9 would fail.
    assert error >= 0.95 * (2 * U + U * U) * x.norm().item() * screen.max_row_norm


def test_a_near_tie_bf16_gets_wrong_is_decided_by_the_fp32_candidates():
    # Row 1's positive half is 1 + u - tiny (rounds down to 1): bf16 sees 0, fp32 about n/2 u.
    # Row 0 is exact in bf16 with one entry a bf16 step above 1: both see 2u. bf16 alone picks
    # row 0; the fp32 argmax is row 1.
    n = 256
    x = torch.ones(1, n)
    tie_lost = torch.cat([torch.full((n // 2,), 1 + U - 2.0**-20), -torch.ones(n // 2)])
    tie_won = torch.cat([torch.ones(n // 2), -torch.ones(n // 2)])
    tie_won[0] = 1 + 2 * U
    others = -0.01 * torch.rand(30, n, generator=torch.Generator().manual_seed(0))
    weight = torch.stack([tie_won, tie_lost, *others])
    screen = ScreenedHead(_head(weight))
    bf16_logits = torch.ops.mkldnn._linear_pointwise(
        x.to(torch.bfloat16), screen.packed_bf16, None, "none", [], ""
    )
    assert int(bf16_logits.argmax()) == 0
    logits = screen.screen(x)
    assert int(logits.argmax()) == int(_fp32_dots(x, weight).argmax()) == 1


@pytest.mark.parametrize("vocab", [4096, 1000])  # in tiles of 64, and as one tile
def test_screened_rows_hold_exact_fp32_candidates_and_the_argmax_of_the_whole_row(vocab):
    torch.manual_seed(0)
    n = 256
    weight = torch.randn(vocab, n) * 0.05
    # Rows with a few large features, as final hidden states often have.
    x = torch.randn(64, n)
    x[:, :4] *= 30
    screen = ScreenedHead(_head(weight))
    logits = screen.screen(x)
    dots = _fp32_dots(x, weight)
    assert torch.equal(logits.argmax(dim=-1), dots.argmax(dim=-1))
    kept = torch.isfinite(logits)
    assert torch.equal(logits[kept], dots[kept])
    assert (logits[~kept] == float("-inf")).all()
    assert screen.stats.num_screened_rows == 64
    assert 64 <= screen.stats.num_candidates < 64 * 64  # a few per row, never the vocabulary


def test_the_head_is_screened_only_inside_screening_and_falls_back_on_non_finite_rows():
    torch.manual_seed(1)
    head = _head(torch.randn(512, 64))
    plain = head(torch.ones(2, 64)).detach()
    screen = ScreenedHead(head)
    x = torch.randn(1, 3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(head(x), nn.functional.linear(x, head.weight))
        with screen.screening(True):
            screened = head(x)
            nan_row = torch.randn(2, 64)
            nan_row[1, 5] = float("nan")
            fallback = head(nan_row)
        assert not screen.active
    assert screened.shape == (1, 3, 512)
    assert torch.equal(screened.argmax(-1), _fp32_dots(x[0], head.weight).argmax(-1).unsqueeze(0))
    assert torch.isnan(fallback[1]).all() and torch.isfinite(fallback[0]).all()
    assert screen.stats.num_fallback_rows == 2
    assert torch.equal(head(torch.ones(2, 64)).detach(), plain)


def test_a_head_with_a_bias_cannot_be_screened():
    with pytest.raises(RuntimeError, match="bias-free"):
        ScreenedHead(nn.Linear(8, 16))


def _tokens_without_and_with_the_screen(toy_dir, prompts, params):
    """Each run's tokens, off then on, and the screened LLM (for its stats)."""
    tokens = []
    for on in (False, True):
        # off: the exact run; on: this fast path alone
        only = {"screen_output_head": True, "prepack_linear": False, "fuse_layers": False}
        fast = only if on else {"exact": True}
        llm = LLM(toy_dir, trust_remote_code=True, block_size=4, **fast)
        tokens.append([o.token_ids for o in llm.generate(prompts, params)])
    return tokens, llm


def test_toy_model_tokens_are_the_same_with_the_screen_and_only_greedy_steps_use_it(tmp_path):
    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    prompts = toy_prompts(random.Random(3), 5)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    (plain, screened), llm = _tokens_without_and_with_the_screen(toy_dir, prompts, greedy)
    assert screened == plain
    stats = llm.output_head_screen.stats
    assert stats.num_screened_rows >= 5 * 6 and stats.num_fallback_rows == 0

    # A sampled request in the batch: no step is screened, and its tokens are the seeded ones.
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=5)
    mixed = [sampled] + [greedy] * 4
    (plain, screened), llm = _tokens_without_and_with_the_screen(toy_dir, prompts, mixed)
    assert screened == plain
    assert llm.output_head_screen.stats.num_screened_rows == 0


def test_step_hooks_see_the_plain_logits(tmp_path):
    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    seen = []
    llm = LLM(
        toy_dir,
        trust_remote_code=True,
        block_size=4,
        screen_output_head=True,
        step_hooks=[lambda record: seen.append(record.logits)],
    )
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen and all(torch.isfinite(logits).all() for logits in seen)
    assert llm.output_head_screen.stats.num_screened_rows == 0


def test_screen_output_head_with_tensor_parallel_is_bad_input(tmp_path):
    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    with pytest.raises(BadInputError, match="one process"):
        LLM(toy_dir, trust_remote_code=True, screen_output_head=True, tensor_parallel_size=2)


def test_run_reports_the_screen_and_keeps_the_toy_tokens(tmp_path, capsys):
    from kvskill.cli import main

    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    common = [str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3,4,5;6,7,8"]
    common += ["--max-tokens", "5", "--ignore-eos", "--format", "json"]
    reports = {}
    only = ["--screen-output-head", "--no-prepack-linear", "--no-fuse-layers"]
    for on, flags in ((False, ["--exact"]), (True, only)):
        with pytest.raises(SystemExit) as exc:
            main(["run", *common, *flags])
        out, _ = capsys.readouterr()
        assert exc.value.code == 0, out
        reports[on] = json.loads(out)
    assert reports[False]["output_head_screen"] is None
    assert reports[True]["output_head_screen"]["num_screened_rows"] == 2 * 5
    tokens = {k: [r["token_ids"] for r in v["requests"]] for k, v in reports.items()}
    assert tokens[True] == tokens[False]


def test_a_bf16_model_cannot_be_screened_and_says_why(tmp_path):
    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    with pytest.raises(BadInputError, match="runs bfloat16 on cpu"):
        LLM(
            toy_dir,
            trust_remote_code=True,
            dtype="bfloat16",
            cpu_only_shapes=True,
            screen_output_head=True,
        )
