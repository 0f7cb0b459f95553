"""``analyze --out``: a workspace for a conversion by hand, that ``verify`` judges."""

from __future__ import annotations

import json
import shutil

import pytest
from kvskill.cli import main
from kvskill.implementer.writer import ApplyOptions, apply_model
from remote_model import write_remote_model

TINY = (
    "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
    "num_key_value_heads=2,head_dim=16,vocab_size=256"
)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_workspace_holds_the_plan_and_the_unconverted_source(tmp_path, capsys):
    import transformers.models.qwen3.modeling_qwen3 as installed

    ws = tmp_path / "ws"
    code, out, err = run_cli(
        capsys, "analyze", "qwen3", "--config-overrides", TINY, "--out", str(ws)
    )
    assert code == 0 and "qwen3" in out
    assert f"edit modeling_qwen3.py, then run kvskill verify {ws} --trust-remote-code" in err
    assert sorted(p.name for p in ws.iterdir()) == [
        "config.json",
        "kvskill_plan.json",
        "modeling_qwen3.py",
    ]
    source = (ws / "modeling_qwen3.py").read_text("utf-8")
    # unconverted, and importable from the workspace (no relative imports of transformers)
    assert "cache_entries" not in source and "get_cache_info" not in source
    assert "from ..." not in source and "from transformers." in source
    plan = json.loads((ws / "kvskill_plan.json").read_text("utf-8"))
    with open(installed.__file__, encoding="utf-8") as fh:
        assert plan["conversion"]["original_source"] == fh.read()
    assert plan["conversion"]["mode"] == "framework"
    assert json.loads((ws / "config.json").read_text("utf-8"))["num_hidden_layers"] == 2


def test_a_bad_out_is_refused_before_any_analysis(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file\n", "utf-8")
    code, out, err = run_cli(capsys, "analyze", "qwen3", "--out", str(tmp_path / "taken"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.md").write_text("mine\n", "utf-8")
    code, out, err = run_cli(capsys, "analyze", "qwen3", "--out", str(tmp_path / "full"))
    assert code == 2 and "pass --force" in err
    assert (tmp_path / "full" / "notes.md").read_text("utf-8") == "mine\n"


def test_a_standalone_plan_gets_no_workspace(tmp_path, capsys):
    code, _, err = run_cli(
        capsys, "analyze", "qwen3", "--mode", "standalone", "--out", str(tmp_path / "ws")
    )
    assert code == 2 and "pass --mode framework" in err
    assert not (tmp_path / "ws").exists()


@pytest.mark.slow
def test_verify_judges_the_hand_converted_workspace(tmp_path, capsys):
    model = write_remote_model(tmp_path / "vendor")
    ws = tmp_path / "ws"
    code, _, _ = run_cli(capsys, "analyze", str(model), "--out", str(ws))
    assert code == 0
    # unedited: the model is not converted yet
    code, _, err = run_cli(capsys, "verify", str(ws), "--trust-remote-code")
    assert code == 3 and "has no get_cache_info()" in err
    # the hand edit (here: what apply writes, put in by hand) makes it verify
    apply_model(str(model), tmp_path / "applied", ApplyOptions())
    for path in (tmp_path / "applied").glob("modeling_*.py"):
        shutil.copy(path, ws / path.name)
    code, _, err = run_cli(capsys, "verify", str(ws))
    assert code == 2 and "--trust-remote-code" in err  # hand-written code is never run unasked
    code, out, err = run_cli(capsys, "verify", str(ws), "--trust-remote-code")
    assert code == 0, err
    assert "PASS" in out
