"""scripts/extract_custom_schemas.py: joined m.def strings and wrapped doc prototypes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "extract_custom_schemas.py"
_spec = importlib.util.spec_from_file_location("extract_custom_schemas", SCRIPT)
extract_custom_schemas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(extract_custom_schemas)

CPP = """\
TORCH_LIBRARY_FRAGMENT(custom, m) {
    m.def("op_b(Tensor x) -> Tensor");

    m.def("op_a(Tensor x, Tensor(a!) state, "
        "int ratio, *,"
        "Tensor? table=None, float eps=1e-6) -> (Tensor)");
}
"""
DOC = """\
# OpA

```
custom.op_a(x, state, ratio, *, table=None,
eps=1e-6) -> Tensor
```
"""


def test_string_pieces_are_joined_and_numbered_by_their_m_def_line():
    schemas = extract_custom_schemas.registered_schemas(CPP)
    assert schemas["op_b"] == (2, "op_b(Tensor x) -> Tensor")
    line, func = schemas["op_a"]
    assert line == 4
    assert func == (
        "op_a(Tensor x, Tensor(a!) state, int ratio, *,Tensor? table=None, float eps=1e-6) "
        "-> (Tensor)"
    )


def test_a_wrapped_doc_prototype_is_read_whole():
    file, line, proto = extract_custom_schemas.doc_prototypes({"custom-op_a.md": DOC})["op_a"]
    assert (file, line) == ("custom-op_a.md", 4)
    assert proto == "op_a(x, state, ratio, *, table=None, eps=1e-6) -> Tensor"
