"""The Plan's JSON Schema: derived from the code, published in references/, and checked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from kvskill.analyzer import analyze_model
from kvskill.analyzer.plan_schema import plan_schema, schema_errors
from kvskill.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _writer():
    spec = importlib.util.spec_from_file_location(
        "write_plan_schema", ROOT / "scripts" / "write_plan_schema.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_published_page_holds_the_schema_of_this_code():
    writer = _writer()
    page = (ROOT / "references" / "plan_schema.md").read_text("utf-8")
    assert page.endswith(writer.MARKER + "\n\n" + writer.schema_block()), (
        "references/plan_schema.md is stale: run scripts/write_plan_schema.py"
    )


def test_schema_names_every_plan_field_and_its_closed_sets():
    schema = plan_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    properties = schema["properties"]
    for key in ("model_type", "kv_mode", "layers", "cache_entries", "sparse_mode", "evidence"):
        assert key in properties and key in schema["required"]
    assert properties["kv_mode"]["enum"] == ["paged", "legacy"]
    layer = schema["$defs"]["LayerPlan"]["properties"]
    assert layer["attn_type"]["enum"] == ["FullAttention", "SlidingWindow", "Mamba", "Legacy"]
    # keys are added freely: objects accept keys the schema does not name
    assert schema["additionalProperties"] is True


@pytest.mark.parametrize("model", ["qwen3", "gpt_oss", "deepseek_v3", "gemma2", "qwen3_next"])
def test_plans_of_every_kind_match(model):
    assert schema_errors(analyze_model(model).to_dict()) == []


def test_mismatches_name_their_json_path():
    data = analyze_model("qwen3").to_dict()
    data["layers"][1]["attn_type"] = "Sliding"
    data["kv_bytes_per_token"] = "many"
    data["mla_absorb"] = 1
    del data["warnings"]
    errors = schema_errors(data)
    assert "$: missing key 'warnings'" in errors
    assert "$.kv_bytes_per_token: expected integer, got string" in errors
    assert "$.mla_absorb: expected boolean, got integer" in errors
    assert any(e.startswith("$.layers[1].attn_type: 'Sliding' is not one of") for e in errors)


def test_cli_prints_the_schema_without_a_model(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "--schema"])
    assert exc.value.code == 0
    assert json.loads(capsys.readouterr().out) == plan_schema()


def test_cli_without_model_or_schema_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["analyze"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "missing argument MODEL" in err
