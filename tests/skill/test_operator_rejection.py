"""A call the real operator would refuse (strict NPU profile) is a failed check, not a bug."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvskill import cli
from kvskill.cli import is_operator_refusal, is_operator_rejection
from kvskill.implementer.writer import ApplyOptions, apply_model
from kvskill.runtime.ops.reference import RefusedOperatorError
from kvskill.runtime.ops.reference._checks import OpInputError

SMALL_QWEN3 = (
    '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, '
    '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128}'
)


def test_an_op_input_error_is_an_operator_rejection_and_other_errors_are_not():
    assert is_operator_rejection(OpInputError("block_size must be a multiple of 16"))
    assert not is_operator_rejection(RuntimeError("something else"))


def test_an_operator_refused_by_name_exits_3_on_one_line(monkeypatch, capsys):
    assert not is_operator_refusal(OpInputError("x")) and not is_operator_rejection(
        RefusedOperatorError("x")
    )

    def refuse(**kwargs):
        raise RefusedOperatorError("torch_npu.npu_quant_matmul: quantized operator")

    monkeypatch.setattr(cli.cli, "main", refuse)
    with pytest.raises(SystemExit) as done:
        cli.main(["run", "somewhere"])
    assert done.value.code == 3
    assert capsys.readouterr().err == (
        "kvskill: error: torch_npu.npu_quant_matmul: quantized operator\n"
    )


def test_run_under_the_npu_limits_with_fp32_exits_1_on_one_line(tmp_path):
    import json

    out = tmp_path / "converted"
    apply_model("qwen3", out, ApplyOptions(config_overrides=json.loads(SMALL_QWEN3)))
    env = {**os.environ, "KVSKILL_NPU_LIMITS": "1"}  # same trust key as the apply above
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvskill",
            "run",
            str(out),
            "--random-weights",
            "--num-requests",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvskill: error: an operator rejected")
    assert "Traceback" not in done.stderr
