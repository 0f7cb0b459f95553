"""``kvskill apply --plan``: convert what a reviewed plan says; refuse a stale one.

Each test writes the plan with ``kvskill analyze --format json``, edits it (or not) as a
reviewer would, and applies it through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvskill.analyzer.plan import CHOICE_FIELDS, fact_fields
from kvskill.cli import main

SMALL = "num_hidden_layers=2"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def write_plan(capsys, path: Path, *args: str) -> dict:
    code, out, err = run_cli(capsys, "analyze", *args, "--format", "json")
    assert code == 0, err
    path.write_text(out, encoding="utf-8")
    return json.loads(out)


def files_of(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(directory.iterdir())}


def test_an_unedited_plan_gives_what_plain_apply_gives(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    write_plan(capsys, plan_file, "qwen3", "--config-overrides", SMALL)

    # apply from the reviewed plan, and apply as usual
    code, _, err = run_cli(
        capsys, "apply", "qwen3", "--config-overrides", SMALL, "--plan", str(plan_file),
        "--out", str(tmp_path / "reviewed"),
    )  # fmt: skip
    assert code == 0, err
    code, _, err = run_cli(
        capsys, "apply", "qwen3", "--config-overrides", SMALL, "--out", str(tmp_path / "plain")
    )
    assert code == 0, err

    # the same files and text; the record says which plan was converted, nothing edited
    reviewed, plain = files_of(tmp_path / "reviewed"), files_of(tmp_path / "plain")
    assert reviewed.keys() == plain.keys()
    for name in plain:
        if name != "kvskill_plan.json":
            assert reviewed[name] == plain[name], name
    got, want = json.loads(reviewed["kvskill_plan.json"]), json.loads(plain["kvskill_plan.json"])
    record = got["conversion"].pop("reviewed_plan")
    assert got == want
    assert record["path"] == str(plan_file) and record["edited"] == []
    assert record["choices"] == {
        "deploy_mode": "framework", "fa_version": "v1", "block_size": 128, "attn_tp_size": 1,
    }  # fmt: skip


def test_a_hand_edited_fa_version_is_converted_and_verifies(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    data = write_plan(capsys, plan_file, "qwen3", "--config-overrides", SMALL)
    assert data["fa_version"] == "v1"
    # the reviewer forces the v2 operator
    data["fa_version"] = "v2"
    plan_file.write_text(json.dumps(data), encoding="utf-8")

    out = tmp_path / "v2"
    code, _, err = run_cli(
        capsys, "apply", "qwen3", "--config-overrides", SMALL, "--plan", str(plan_file),
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err

    # the converted attention calls the v2 operator, and the record says it was edited
    code_text = (out / "modeling_qwen3.py").read_text(encoding="utf-8")
    assert "npu_fused_infer_attention_score_v2(" in code_text
    assert "npu_fused_infer_attention_score(" not in code_text
    written = json.loads((out / "kvskill_plan.json").read_text(encoding="utf-8"))
    assert written["fa_version"] == "v2"
    assert written["conversion"]["reviewed_plan"]["edited"] == ["fa_version"]
    (note,) = [e for e in written["evidence"] if e["source"] == f"--plan {plan_file}"]
    assert note["decision"] == "fa_version" and "analysis decides v1" in note["reason"]

    # and the v2 conversion is token-exact against the original
    code, stdout, err = run_cli(capsys, "verify", str(out), "--format", "json")
    assert code == 0, json.loads(stdout)["failures"]


def test_a_hand_edited_deploy_mode_writes_the_standalone_runner(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    data = write_plan(capsys, plan_file, "qwen3", "--config-overrides", SMALL)
    data["deploy_mode"] = "standalone"
    plan_file.write_text(json.dumps(data), encoding="utf-8")

    out = tmp_path / "standalone"
    code, _, err = run_cli(
        capsys, "apply", "qwen3", "--config-overrides", SMALL, "--plan", str(plan_file),
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert (out / "runner_qwen3.py").is_file()
    written = json.loads((out / "kvskill_plan.json").read_text(encoding="utf-8"))
    assert written["deploy_mode"] == "standalone"
    assert written["conversion"]["mode"] == "standalone"
    assert written["conversion"]["standalone"]["runner"] == "runner_qwen3.py"


def test_a_stale_plan_is_refused_naming_the_fields(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    write_plan(capsys, plan_file, "qwen3", "--config-overrides", SMALL)

    # the model changed since the review: one more layer, fewer KV heads
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys, "apply", "qwen3", "--config-overrides",
        "num_hidden_layers=3,num_key_value_heads=4", "--plan", str(plan_file), "--out", str(out),
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "no longer matches qwen3" in err
    named = err.split(" differ;")[0]
    assert "num_layers (plan 2, model 3)" in named
    assert "num_key_value_heads (plan 32, model 4)" in named
    assert "attention (plan 'mha', model 'gqa')" in named
    # recomputed fields and notes are not facts: never named
    assert not any(n in named for n in ("fa_version", "cache_entries", "evidence", "warnings"))
    assert not out.exists()  # nothing written


def test_a_hand_edited_fact_is_refused(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    data = write_plan(capsys, plan_file, "qwen3", "--config-overrides", SMALL)
    data["softmax_scale"] = 1.0  # a fact of the model, not a choice
    plan_file.write_text(json.dumps(data), encoding="utf-8")
    code, _, err = run_cli(
        capsys, "apply", "qwen3", "--config-overrides", SMALL, "--plan", str(plan_file),
        "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 2 and "softmax_scale (plan 1.0, model 0.0883" in err


def test_flags_that_the_plan_decides_are_refused_with_it(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    write_plan(capsys, plan_file, "qwen3", "--config-overrides", SMALL)
    base = ["apply", "qwen3", "--config-overrides", SMALL, "--plan", str(plan_file), "--dry-run"]
    code, _, err = run_cli(capsys, *base, "--fa-version", "v2")
    assert code == 2 and "--fa-version v2 contradicts fa_version=v1" in err
    code, _, err = run_cli(capsys, *base, "--mode", "standalone")
    assert code == 2 and "the plan's deploy_mode decides it" in err
    # a bad plan file is one line of bad input
    plan_file.write_text("{", encoding="utf-8")
    code, _, err = run_cli(capsys, *base)
    assert code == 2 and "is not valid JSON" in err and err.count("\n") == 1


def test_every_plan_field_is_a_choice_a_fact_or_recomputed():
    from dataclasses import fields

    from kvskill.analyzer.plan import DERIVED_FIELDS, NOTE_FIELDS, Plan

    sorts = [set(CHOICE_FIELDS), set(fact_fields()), set(DERIVED_FIELDS), set(NOTE_FIELDS)]
    assert set().union(*sorts) == {f.name for f in fields(Plan)}
    assert sum(len(s) for s in sorts) == len(fields(Plan))  # no field is of two sorts
    assert {"layers", "num_layers", "num_key_value_heads", "config", "attention"} <= sorts[1]
