"""verify and run check the operator calls against the NPU's limits unless told not to.

The suite itself opts out (``KVSKILL_CPU_ONLY_SHAPES=1`` in tests/conftest.py); every test
here removes that with the ``npu_profile_default`` fixture, so it sees what a user gets.
"""

from __future__ import annotations

import json

import pytest
from kvskill.cli import main
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.verify.flow import verify_directory
from kvskill.verify.options import VerifyOptions
from kvskill.verify.table import format_table

#: a one-layer qwen3 whose head dims the NPU takes (32: 16-aligned)
SMALL_QWEN3 = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 128,
}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory):
    out = tmp_path_factory.mktemp("npu-profile") / "qwen3"
    apply_model("qwen3", out, ApplyOptions(config_overrides=SMALL_QWEN3))
    return out


@pytest.mark.parametrize(
    "command", [["verify"], ["run", "--random-weights", "--num-requests", "1"]]
)
def test_a_tiny_block_size_is_refused_by_default_with_the_limit_and_the_opt_out(
    capsys, npu_profile_default, small_qwen3, command
):
    code, _, err = run_cli(capsys, command[0], str(small_qwen3), *command[1:], "--block-size", "4")
    # exit 2 before any model is built, one line naming the limit, its doc section, the way out
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "block size 4 is not an NPU block size" in err
    assert "a multiple of 128 in [128, 512]" in err
    assert "当Q_S大于1时 › page attention场景" in err and "npu_ops.md §9" in err
    assert "--cpu-only-shapes" in err


@pytest.mark.slow  # about 5 s: prompts spanning several 128-token blocks
def test_the_default_verify_passes_the_npu_profile_and_says_what_it_did_not_check(
    npu_profile_default, small_qwen3
):
    report = verify_directory(small_qwen3, VerifyOptions(num_prompts=2, max_new_tokens=2))
    assert report.passed, report.failures()
    # the NPU block size, and prompts that span several such blocks
    assert report.block_size == 128
    assert max(p.prompt_len for p in report.prompts) > 2 * 128
    limits = report.to_dict()["npu_limits"]
    assert limits["checked"] is True
    assert limits["checked_kinds"] == ["shapes"]
    # the twin's head dims are not the model's, and float32 is a CPU-only convenience
    not_checked = " ".join(limits["not_checked"])
    assert "shrunk twin" in not_checked
    assert "float32 is a CPU-only convenience" in not_checked
    assert limits["model_limits"] == []  # the real config hits no documented limit
    text = format_table(report)
    assert "NPU limits: checked (block sizes" in text
    assert "NOT checked: head counts and head dims" in text
    assert "greedy tokens vs original" in text  # float32: the original in the same dtype


def test_cpu_only_shapes_runs_tiny_blocks_and_the_json_says_not_checked(
    capsys, npu_profile_default, small_qwen3
):
    code, out, _ = run_cli(
        capsys, "verify", str(small_qwen3), "--cpu-only-shapes", "--block-size", "4",
        "--num-prompts", "1", "--max-new-tokens", "2", "--format", "json",
    )  # fmt: skip
    report = json.loads(out)
    assert code == 0 and report["passed"]
    assert report["block_size"] == 4
    assert report["npu_limits"]["checked"] is False
    assert report["npu_limits"]["profile"] == "cpu-only-shapes"
    assert "NOT checked against the NPU operators' limits" in report["npu_limits"]["not_checked"][0]


def test_run_checks_real_dims_and_in_bfloat16_the_dtypes(capsys, npu_profile_default, small_qwen3):
    args = ["run", str(small_qwen3), "--random-weights", "--num-requests", "1"]
    args += ["--prompt-len", "8", "--max-tokens", "2", "--num-blocks", "4"]
    code, out, _ = run_cli(capsys, *args, "--format", "json")
    report = json.loads(out)
    assert code == 0
    assert report["kv_cache"]["FullAttention"]["block_size"] == 128  # the model's own default
    assert report["npu_limits"]["checked_kinds"] == ["shapes", "dims"]
    assert "float32 is a CPU-only convenience" in report["npu_limits"]["not_checked"][0]
    code, out, _ = run_cli(capsys, *args, "--dtype", "bfloat16")
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("NPU limits")]
    assert "checked (block sizes" in line and "dtypes (float16/bfloat16 only)" in line
    assert "NOT checked" not in line


def test_a_limit_the_model_hits_is_one_line_naming_it_and_the_opt_out(
    capsys, tmp_path, monkeypatch, npu_profile_default
):
    # head dim 40: the NPU's prompt branch needs D 16-aligned (约束说明 › 当Q_S大于1时)
    out = tmp_path / "qwen3-d40"
    apply_model("qwen3", out, ApplyOptions(config_overrides={**SMALL_QWEN3, "head_dim": 40}))
    args = ["run", str(out), "--random-weights", "--num-requests", "1", "--prompt-len", "8"]
    args += ["--max-tokens", "2", "--num-blocks", "4"]
    code, _, err = run_cli(capsys, *args)
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "query head dim 40 must be a multiple of 16 when Q_S > 1" in err
    assert "npu_ops.md §9" in err and "--cpu-only-shapes" in err
    # with the opt-out the CPU reference runs it
    code, _, _ = run_cli(capsys, *args, "--cpu-only-shapes")
    assert code == 0
