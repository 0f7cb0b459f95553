"""``kvskill lint`` on the command line: output shapes and exit codes."""

from __future__ import annotations

import json

import pytest
from kvskill.analyzer.lint import RULES, python_files
from kvskill.cli import main
from kvskill.core.errors import BadInputError

CLEAN = """\
from kvskill.runtime.ops import torch_npu


def attend(self, q, k, v, md):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=self.scaling, atten_mask=md.attention_mask, sparse_mode=3,
        block_table=md.block_table[self.attn_type], block_size=16,
        actual_seq_lengths=md.actual_seq_lengths_cu_q,
        actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
# Two mistakes: v2 scale name on v1 (line 6) and no causal mask (line 5).
BROKEN = """\
from kvskill.runtime.ops import torch_npu


def attend(self, q, k, v, md):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, softmax_scale=self.scaling, sparse_mode=0)
"""


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "clean.py").write_text(CLEAN)
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "notes.txt").write_text("not python, not linted")
    hidden = tmp_path / ".cache"
    hidden.mkdir()
    (hidden / "ignored.py").write_text(BROKEN)
    return tmp_path


def test_clean_file_exits_0(capsys, tree):
    code, out, _ = run_cli(capsys, "lint", str(tree / "clean.py"))
    assert code == 0
    assert "no findings" in out


def test_findings_exit_1_with_file_line_rule_message_fix(capsys, tree):
    code, out, _ = run_cli(capsys, "lint", str(tree / "broken.py"))
    assert code == 1
    lines = out.strip().splitlines()
    path = str(tree / "broken.py")
    assert lines[0].startswith(f"{path}:5:12 KV001 ")
    assert lines[1].startswith(f"{path}:6:31 KV005 ")
    assert all(" — fix: " in line for line in lines[:2])
    assert lines[-1] == "2 finding(s) in 1 file"


def test_json_is_one_object_with_findings_and_file_count(capsys, tree):
    code, out, err = run_cli(capsys, "lint", str(tree), "--format", "json")
    assert code == 1
    payload = json.loads(out)
    assert payload["files"] == 2  # clean.py and broken.py; hidden folders and .txt skipped
    assert payload["errors"] == []
    assert [(f["rule"], f["line"]) for f in payload["findings"]] == [("KV001", 5), ("KV005", 6)]
    for finding in payload["findings"]:
        assert set(finding) == {"path", "line", "column", "rule", "name", "message", "fix"}
        assert finding["path"].endswith("broken.py")
    assert err == ""


def test_disable_by_id_and_name(capsys, tree):
    code, out, _ = run_cli(
        capsys, "lint", str(tree / "broken.py"), "--disable", "KV001",
        "--disable", "fa-keyword-version-mismatch", "--format", "json",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["findings"] == []


def test_unknown_rule_is_bad_input(capsys, tree):
    code, _, err = run_cli(capsys, "lint", str(tree / "clean.py"), "--disable", "KV999")
    assert code == 2
    assert "KV999" in err and "Traceback" not in err


def test_syntax_error_alone_exits_2_and_others_are_still_checked(capsys, tmp_path):
    (tmp_path / "a_bad.py").write_text("def broken(:\n    pass\n")
    (tmp_path / "b_clean.py").write_text(CLEAN)
    code, out, _ = run_cli(capsys, "lint", str(tmp_path), "--format", "json")
    assert code == 2
    payload = json.loads(out)
    assert payload["files"] == 2
    assert payload["findings"] == []
    assert len(payload["errors"]) == 1
    assert payload["errors"][0]["path"].endswith("a_bad.py")
    assert payload["errors"][0]["line"] == 1
    assert payload["errors"][0]["message"].startswith("cannot parse")


def test_findings_win_over_a_syntax_error(capsys, tmp_path):
    (tmp_path / "a_bad.py").write_text("x = (\n")
    (tmp_path / "b_broken.py").write_text(BROKEN)
    code, out, _ = run_cli(capsys, "lint", str(tmp_path))
    assert code == 1
    assert "a_bad.py:" in out and "error: cannot parse" in out
    assert "b_broken.py:5:12 KV001" in out


def test_folder_without_python_files_is_bad_input(capsys, tmp_path):
    (tmp_path / "readme.md").write_text("# nothing here")
    code, _, err = run_cli(capsys, "lint", str(tmp_path))
    assert code == 2
    assert "no Python files" in err


def test_folder_walk_stops_past_its_limit(tmp_path):
    for index in range(30):
        (tmp_path / f"d{index}").mkdir()
        (tmp_path / f"d{index}" / "m.py").write_text("x = 1\n")
    assert len(python_files([tmp_path], max_entries=100)) == 30
    with pytest.raises(BadInputError, match="more than 40 files and folders"):
        python_files([tmp_path], max_entries=40)


def test_folder_walk_skips_hidden_and_cache_folders_and_symlinked_folders(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "modeling_x.py").write_text("x = 1\n")
    for skipped in (".git", "__pycache__", "node_modules"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "y.py").write_text("y = 1\n")
    (tmp_path / "loop").symlink_to(tmp_path, target_is_directory=True)
    assert python_files([tmp_path]) == [tmp_path / "model" / "modeling_x.py"]


def test_missing_path_is_a_usage_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "lint", str(tmp_path / "absent.py"))
    assert code == 2
    assert "does not exist" in err


def test_help_lists_every_rule(capsys):
    code, out, _ = run_cli(capsys, "lint", "--help")
    assert code == 0
    for rule in RULES:
        assert rule.id in out and rule.name in out


def test_a_crashing_rule_costs_one_error_line_not_the_run(capsys, tree, monkeypatch):
    from kvskill.analyzer.lint.rules.kv009_num_head_per_rank import NumHeadNotPerRank

    def explode(self, ctx):
        raise ValueError("unexpected shape of code")
        yield  # pragma: no cover - makes this a generator like the real check

    monkeypatch.setattr(NumHeadNotPerRank, "check", explode)
    code, out, _ = run_cli(capsys, "lint", str(tree / "broken.py"), "--format", "json")
    payload = json.loads(out)
    assert code == 1  # the other rules still ran and found the two mistakes
    assert [f["rule"] for f in payload["findings"]] == ["KV001", "KV005"]
    assert len(payload["errors"]) == 1
    assert "KV009" in payload["errors"][0]["message"]
    assert "ValueError" in payload["errors"][0]["message"]
