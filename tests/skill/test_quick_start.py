"""The README's Quick start, run verbatim in a fresh folder, works on a small machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start_lines() -> list[str]:
    """The shell lines of the first bash block under '## Quick start', comments dropped."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the Quick start has no bash block"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_quick_start_says_how_to_put_kvskill_on_path():
    lines = quick_start_lines()
    assert lines[0] == 'export PATH="$PWD/.venv/bin:$PATH"'
    assert all(line.startswith("kvskill ") for line in lines[1:])


@pytest.mark.slow
def test_quick_start_runs_verbatim(tmp_path):
    # The venv's bin folder stands for "$PWD/.venv/bin" of a fresh clone after `make demo`.
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "kvskill").is_file(), "kvskill is not installed in this venv"
    fake_clone = tmp_path / "clone"
    (fake_clone / ".venv").mkdir(parents=True)
    (fake_clone / ".venv" / "bin").symlink_to(bin_dir)
    # a user's default: verify and run check the NPU limits (the suite's opt-out removed)
    user_env = {k: v for k, v in os.environ.items() if k != "KVSKILL_CPU_ONLY_SHAPES"}
    env = {
        **user_env,
        "HOME": str(tmp_path / "home"),
        "PATH": "/usr/bin:/bin",
        "KVSKILL_KERNEL_CACHE": os.environ.get(
            "KVSKILL_KERNEL_CACHE", str(Path.home() / ".cache" / "kvskill" / "cpu_kernels")
        ),
    }
    script = "set -e\n" + "\n".join(quick_start_lines()) + "\n"
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=fake_clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PASSED" in proc.stdout
    assert "NPU limits: checked (block sizes" in proc.stdout
    assert (fake_clone / "converted" / "kvskill_plan.json").is_file()
    assert (fake_clone / ".claude" / "skills" / "model-infer-kvcache" / "SKILL.md").is_file()
