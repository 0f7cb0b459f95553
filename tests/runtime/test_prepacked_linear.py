"""The opt-in oneDNN prepacked linear layers: close to nn.Linear (not bit-exact), the weights
and state dict untouched, and the toy model's greedy tokens unchanged with it on."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from kvskill.runtime import LLM, SamplingParams  # noqa: E402
from kvskill.runtime.prepacked_linear import prepack_linears, unavailable_reason  # noqa: E402
from toy_factory import toy_prompts, write_toy_dir  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def test_packed_linear_matches_nn_linear_within_rounding_and_keeps_the_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 32, bias=False))
    x = torch.randn(3, 5, 48)
    with torch.inference_mode():
        expected = model(x)
    keys_before = set(model.state_dict())
    assert prepack_linears(model) == 2
    with torch.inference_mode():
        got = model(x)
        got_2d = model(x[0])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_2d, expected[0], rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == keys_before


def test_a_non_fp32_input_falls_back_to_nn_linear():
    layer = nn.Linear(8, 4)
    prepack_linears(layer)
    x = torch.randn(2, 8, dtype=torch.float64)
    expected = nn.functional.linear(x, layer.weight.double(), layer.bias.double())
    with torch.inference_mode():
        layer.double()
        torch.testing.assert_close(layer(x), expected)


@pytest.mark.slow
def test_toy_model_greedy_tokens_are_the_same_with_prepacked_linear(tmp_path):
    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    prompts = toy_prompts(random.Random(3), 4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for on in (False, True):
        # off: the exact run; on: this fast path alone
        only = {"prepack_linear": True, "fuse_layers": False, "screen_output_head": False}
        fast = only if on else {"exact": True}
        llm = LLM(toy_dir, trust_remote_code=True, block_size=4, **fast)
        outs[on] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


class _Attention(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 64, bias=bias)
        self.k_proj = nn.Linear(32, 16, bias=False)
        self.v_proj = nn.Linear(32, 16, bias=bias)

    def forward(self, x, other=None):
        # k first and v on another input when given: order and inputs must not matter
        k = self.k_proj(x)
        q = self.q_proj(x)
        v = self.v_proj(x if other is None else other)
        return q, k, v


@pytest.mark.parametrize("bias", [False, True])
def test_fused_siblings_give_each_projection_its_own_columns(bias):
    torch.manual_seed(1)
    module = _Attention(bias)
    x, other = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    with torch.inference_mode():
        expected = [module(x), module(x, other)]
    assert prepack_linears(module) == 3
    assert module.q_proj._kvskill_fused is module.v_proj._kvskill_fused
    with torch.inference_mode():
        got = [module(x), module(x, other)]
    for want, have in zip(expected, got, strict=True):
        for w, h in zip(want, have, strict=True):
            assert h.is_contiguous() and h.shape == w.shape
            torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        module(x)
    # every member served from one input: the group holds no activation between calls
    assert module.q_proj._kvskill_fused._output is None


def test_a_sibling_input_changed_in_place_is_projected_again():
    torch.manual_seed(2)
    module = _Attention(False)
    prepack_linears(module)
    x = torch.randn(4, 32)
    with torch.no_grad():  # (inference tensors keep no version counter)
        module.q_proj(x)
        x.mul_(2)
        k = module.k_proj(x)
        torch.testing.assert_close(k, nn.functional.linear(x, module.k_proj.weight))


def test_fusing_can_be_turned_off():
    module = _Attention(False)
    prepack_linears(module, fuse_siblings=False)
    assert not hasattr(module.q_proj, "_kvskill_fused")
    assert hasattr(module.q_proj, "_kvskill_packed")


def _run(capsys, *args):
    from kvskill.cli import main
    from kvskill.core.errors import ExitCode

    with pytest.raises(SystemExit) as exc:
        main(["run", *args])
    out, err = capsys.readouterr()
    return ExitCode(exc.value.code), out, err


def test_run_prepack_linear_reports_the_packed_layers_and_keeps_the_toy_tokens(tmp_path, capsys):
    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    common = [str(toy_dir), "--trust-remote-code", "--prompt-ids", "1,2,3,4,5;6,7,8"]
    common += ["--max-tokens", "5", "--ignore-eos", "--format", "json"]
    reports = {}
    only = ["--prepack-linear", "--no-fuse-layers", "--no-screen-output-head"]
    for on, flags in ((False, ["--exact"]), (True, only)):
        code, out, _ = _run(capsys, *common, *flags)
        assert code == 0, out
        reports[on] = json.loads(out)
    assert reports[False]["prepacked_linear_layers"] == 0
    assert reports[False]["fast_paths"]["prepack_linear"]["reason"].startswith("exact run")
    assert reports[True]["prepacked_linear_layers"] > 0
    tokens = {k: [r["token_ids"] for r in v["requests"]] for k, v in reports.items()}
    assert tokens[True] == tokens[False]


def test_prepack_linear_with_tensor_parallel_is_bad_input(tmp_path):
    from kvskill.core.errors import BadInputError

    toy_dir = write_toy_dir(tmp_path / "model", seed=7)
    with pytest.raises(BadInputError, match="one process"):
        LLM(toy_dir, trust_remote_code=True, prepack_linear=True, tensor_parallel_size=2)
