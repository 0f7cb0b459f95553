"""scripts/extract_npu_schemas.py: which yaml entry and doc block it records per operator."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "extract_npu_schemas.py"
_spec = importlib.util.spec_from_file_location("extract_npu_schemas", SCRIPT)
extract_npu_schemas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(extract_npu_schemas)

YAML = """\
custom:
- func: op_a.Tensor(Tensor self, Tensor dst) -> Tensor
- exposed: true
  func: op_a(Tensor self, int acl_format, *, int? customize_dtype=None) -> Tensor
- func: _op_a(Tensor self) -> Tensor
symint:
- func: op_a(Tensor self, int other) -> Tensor
"""
DOCS = '''\
_add_torch_npu_docstr(
    "op_a",
    """
op_a docs
"""
)
'''


def test_the_first_overload_free_entry_wins_with_its_line_number():
    schemas = extract_npu_schemas.primary_schemas(YAML)
    line, func = schemas["op_a"]
    assert line == 4
    assert func == "op_a(Tensor self, int acl_format, *, int? customize_dtype=None) -> Tensor"
    assert "_op_a" in schemas and "op_a.Tensor" not in schemas


def test_doc_blocks_are_found_by_their_registration_call():
    assert extract_npu_schemas.doc_blocks(DOCS) == {"op_a": 2}


def test_extract_writes_every_listed_operator_or_refuses(tmp_path, monkeypatch):
    wheel = tmp_path / "torch_npu-9.9.9-cp311-cp311-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(extract_npu_schemas.SCHEMA_YAML, YAML)
        archive.writestr(extract_npu_schemas.DOCS_PY, DOCS)
    monkeypatch.setattr(extract_npu_schemas, "OPERATORS", ("op_a",))
    fixture = extract_npu_schemas.extract(wheel, "9.9.9")
    func = "op_a(Tensor self, int acl_format, *, int? customize_dtype=None) -> Tensor"
    assert fixture["operators"] == {"op_a": {"yaml_line": 4, "func": func, "doc_line": 2}}
    json.dumps(fixture)  # serialisable as written to tests/fixtures
    monkeypatch.setattr(extract_npu_schemas, "OPERATORS", ("op_a", "op_missing"))
    with pytest.raises(SystemExit, match="op_missing"):
        extract_npu_schemas.extract(wheel, "9.9.9")
