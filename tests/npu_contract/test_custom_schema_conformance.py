"""The framework's custom operators (``torch.ops.custom``) bind as its extension defines them.

The schemas come from tests/fixtures/custom_schemas.json (scripts/extract_custom_schemas.py,
read from a cann-recipes-infer checkout), so this runs offline: the reference functions, the
schemas the stand-in registers and the operators' doc prototypes all agree with the extension's
``m.def`` lines, and none of these operators is in the torch_npu wheel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from aten_schema import load_fixture, parse_schema
from kvskill.runtime.ops.npu_standin import npu_standin
from kvskill.runtime.ops.reference import custom
from signature_diff import signature_differences

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "custom_schemas.json"
RECORDED = json.loads(FIXTURE.read_text())
OPERATORS = RECORDED["operators"]
IMPLEMENTED = sorted(name for name, op in OPERATORS.items() if op["implemented"])


def _shape(schema):
    return [(p.name, p.base_type, p.optional, p.keyword_only, p.default) for p in schema.params]


def test_the_fixture_records_the_framework_commit_and_lines():
    assert RECORDED["commit"].startswith("fbc225d")
    for name, op in OPERATORS.items():
        assert op["registration_line"] > 0, name
        assert op["func"].startswith(f"{name}("), name
    assert sorted(custom.SCHEMAS) == IMPLEMENTED


def test_none_of_them_is_in_the_torch_npu_wheel():
    absent = set(load_fixture()["absent"])
    assert sorted(set(IMPLEMENTED) - absent) == []


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_the_reference_signature_matches_the_extension_schema(name):
    schema = parse_schema(OPERATORS[name]["func"])
    assert signature_differences(getattr(custom, name), schema) == []


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_the_standin_registers_the_extension_schema(name):
    want = parse_schema(OPERATORS[name]["func"])
    assert _shape(parse_schema(custom.SCHEMAS[name])) == _shape(want)
    with npu_standin():
        live = str(getattr(torch.ops.custom, name).default._schema).removeprefix("custom::")
    assert _shape(parse_schema(live)) == _shape(want)
    # the in-place state write is declared, so captured graphs keep it
    mutated = [p.name for p in want.params if "!" in p.type]
    assert [p.name for p in parse_schema(live).params if "!" in p.type] == mutated


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_the_doc_prototype_names_the_same_arguments_and_defaults(name):
    doc = parse_schema(OPERATORS[name]["doc_prototype"])
    reg = parse_schema(OPERATORS[name]["func"])
    assert [(p.name, p.keyword_only, p.default) for p in doc.params] == [
        (p.name, p.keyword_only, p.default) for p in reg.params
    ]


def test_the_quantized_indexer_doc_and_registration_differ_as_recorded():
    # its doc (custom-npu_quant_lightning_indexer.md:22) omits the two positional quant modes
    # and query_dtype / key_dtype that the registration defines: the registration binds
    op = OPERATORS["npu_quant_lightning_indexer"]
    reg = parse_schema(op["func"])
    assert [p.name for p in reg.params if not p.keyword_only][-2:] == [
        "query_quant_mode",
        "key_quant_mode",
    ]
    assert "query_quant_mode" in op["doc_prototype"].split("*")[1]
    assert not op["implemented"]
