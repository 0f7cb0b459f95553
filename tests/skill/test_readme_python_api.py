"""The README's Python API example runs as written on a converted directory."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from kvskill.implementer.writer import ApplyOptions, apply_model

README = Path(__file__).resolve().parents[2] / "README.md"
SMALL_QWEN3 = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 256,
}


def _python_api_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_python_api_example_runs_on_a_converted_directory(
    tmp_path, monkeypatch, npu_profile_default
):  # as a user runs it: with the NPU profile
    apply_model("qwen3", tmp_path / "converted", ApplyOptions(config_overrides=SMALL_QWEN3))
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_python_api_block(), "README.md (Python API)", "exec"), {})
    lines = printed.getvalue().splitlines()
    # two greedy requests of 8 tokens, then the streamed tokens of one request, then the stats
    assert [len(eval(line.split("]")[0] + "]")) for line in lines[:2]] == [8, 8]
    streamed = [line for line in lines[2:] if line.split()[0].endswith("-0")]
    assert len(streamed) >= 1 and "length" in streamed[-1].lower()
    assert lines[-1].startswith("EngineStats(")
