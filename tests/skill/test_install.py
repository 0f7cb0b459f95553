"""``kvskill skill install`` / ``show``: idempotent, atomic, and careful with edited copies."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kvskill import resources
from kvskill.cli import main
from kvskill.core.errors import BadInputError
from kvskill.install import MANIFEST, Action, Agent, default_target, install_skill


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture
def pack(tmp_path) -> list[tuple[str, Path]]:
    """A small skill pack (SKILL.md + two reference pages) to install in tests."""
    src = tmp_path / "src"
    (src / "references").mkdir(parents=True)
    (src / "SKILL.md").write_text("---\nname: model-infer-kvcache\n---\nbody v1\n")
    (src / "references" / "a.md").write_text("# a v1\n")
    (src / "references" / "b.md").write_text("# b v1\n")
    return [
        ("SKILL.md", src / "SKILL.md"),
        ("references/a.md", src / "references" / "a.md"),
        ("references/b.md", src / "references" / "b.md"),
    ]


def actions(result) -> dict[str, Action]:
    return {name: action for action, name in result.actions}


def test_first_install_copies_every_file_and_records_hashes(tmp_path, pack):
    result = install_skill(target=tmp_path / "skills", files=pack)
    dest = tmp_path / "skills" / "model-infer-kvcache"
    assert result.directory == dest
    assert set(actions(result).values()) == {Action.CREATED}
    for name, src in pack:
        assert (dest / name).read_bytes() == src.read_bytes()
    manifest = json.loads((dest / MANIFEST).read_text())
    assert set(manifest["files"]) == {name for name, _ in pack}
    # No temporary files are left behind by the atomic writes.
    assert sorted(p.name for p in dest.rglob("*") if p.is_file()) == sorted(
        [MANIFEST, "SKILL.md", "a.md", "b.md"]
    )


def test_second_install_changes_nothing_and_says_so(tmp_path, pack):
    install_skill(target=tmp_path, files=pack)
    dest = tmp_path / "model-infer-kvcache"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in dest.rglob("*") if p.is_file()}
    result = install_skill(target=tmp_path, files=pack)
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in dest.rglob("*") if p.is_file()}
    assert not result.changed
    assert after == before
    assert "up to date" in result.describe()[0]


def test_pristine_old_copy_is_updated(tmp_path, pack):
    install_skill(target=tmp_path, files=pack)
    # A newer kvskill ships a different a.md; the installed copy is untouched.
    pack[1][1].write_text("# a v2\n")
    result = install_skill(target=tmp_path, files=pack)
    assert actions(result)["references/a.md"] is Action.UPDATED
    assert actions(result)["SKILL.md"] is Action.UNCHANGED
    assert (tmp_path / "model-infer-kvcache/references/a.md").read_text() == "# a v2\n"


def test_edited_copy_is_refused_without_force_and_nothing_is_written(tmp_path, pack):
    install_skill(target=tmp_path, files=pack)
    dest = tmp_path / "model-infer-kvcache"
    (dest / "references/b.md").write_text("# b, my notes\n")
    pack[1][1].write_text("# a v2\n")  # an update is pending for another file
    with pytest.raises(BadInputError, match=r"references/b\.md.*--force"):
        install_skill(target=tmp_path, files=pack)
    # The refusal happened before any write: a.md was not updated either.
    assert (dest / "references/a.md").read_text() == "# a v1\n"
    assert (dest / "references/b.md").read_text() == "# b, my notes\n"


def test_force_overwrites_the_edited_copy(tmp_path, pack):
    install_skill(target=tmp_path, files=pack)
    dest = tmp_path / "model-infer-kvcache"
    (dest / "SKILL.md").write_text("edited\n")
    result = install_skill(target=tmp_path, files=pack, force=True)
    assert actions(result)["SKILL.md"] is Action.OVERWRITTEN
    assert (dest / "SKILL.md").read_bytes() == pack[0][1].read_bytes()
    assert not install_skill(target=tmp_path, files=pack).changed


def test_unknown_file_in_the_way_counts_as_edited(tmp_path, pack):
    dest = tmp_path / "model-infer-kvcache"
    dest.mkdir()
    (dest / "SKILL.md").write_text("someone else's skill\n")
    with pytest.raises(BadInputError, match="SKILL.md"):
        install_skill(target=tmp_path, files=pack)


def test_page_no_longer_shipped_is_removed_unless_edited(tmp_path, pack):
    install_skill(target=tmp_path, files=pack)
    dest = tmp_path / "model-infer-kvcache"
    (dest / "references/b.md").write_text("# b, my notes\n")
    result = install_skill(target=tmp_path, files=pack[:1])  # a.md and b.md dropped
    assert actions(result)["references/a.md"] is Action.REMOVED
    assert actions(result)["references/b.md"] is Action.KEPT
    assert not (dest / "references/a.md").exists()
    assert (dest / "references/b.md").read_text() == "# b, my notes\n"


def test_default_target_is_the_git_toplevel(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    assert default_target(Agent.CLAUDE, repo / "sub") == repo.resolve() / ".claude/skills"
    assert default_target(Agent.AGENTS, repo / "sub") == repo.resolve() / ".agents/skills"
    outside = tmp_path / "plain"
    outside.mkdir()
    # Not in a repository: the folder itself is the project.
    assert default_target(Agent.CLAUDE, outside) == outside / ".claude/skills"


def test_cli_install_prints_what_it_wrote_then_is_idempotent(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "skill", "install", "--target", str(tmp_path))
    assert code == 0
    dest = tmp_path / "model-infer-kvcache"
    assert f"created     {dest / 'SKILL.md'}" in out
    assert (dest / "SKILL.md").read_text() == resources.skill_md().read_text()
    for page in resources.reference_pages():
        assert (dest / "references" / page.name).read_text() == page.read_text()
    code, out, _ = run_cli(capsys, "skill", "install", "--target", str(tmp_path))
    assert code == 0
    assert "up to date" in out


def test_cli_refuses_an_edited_copy_with_exit_2_and_one_line(capsys, tmp_path):
    run_cli(capsys, "skill", "install", "--target", str(tmp_path))
    (tmp_path / "model-infer-kvcache" / "SKILL.md").write_text("mine\n")
    code, _, err = run_cli(capsys, "skill", "install", "--target", str(tmp_path))
    assert code == 2
    assert err.count("\n") == 1 and "SKILL.md" in err and "--force" in err
    code, _, _ = run_cli(capsys, "skill", "install", "--target", str(tmp_path), "--force")
    assert code == 0


def test_cli_default_target_uses_the_agent_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    code, _, _ = run_cli(capsys, "skill", "install", "--agent", "agents")
    assert code == 0
    assert (tmp_path / ".agents/skills/model-infer-kvcache/SKILL.md").is_file()


def test_target_that_is_a_file_is_bad_input(capsys, tmp_path):
    (tmp_path / "model-infer-kvcache").write_text("a file")
    code, _, err = run_cli(capsys, "skill", "install", "--target", str(tmp_path))
    assert code == 2
    assert "not a folder" in err


def test_show_prints_skill_md(capsys):
    code, out, _ = run_cli(capsys, "skill", "show")
    assert code == 0
    assert out == resources.skill_md().read_text(encoding="utf-8")
