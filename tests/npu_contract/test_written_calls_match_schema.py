"""Every ``torch_npu.<op>(...)`` call kvskill writes or teaches binds under the 2.13.0 schema.

The dry run checks the calls converted models make at run time; this reads the calls written in
the implementer's templates and snippets and in the skill's pages (SKILL.md, references/), so
an example an agent copies cannot use a keyword the real binding rejects.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from aten_schema import load_schemas

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = load_schemas()
SOURCES = sorted(
    [
        *REPO.glob("templates/*.j2"),
        *REPO.glob("implementer/**/*.py"),
        *REPO.glob("references/*.md"),
        REPO / "SKILL.md",
    ]
)
_CALL = re.compile(r"torch_npu\.([A-Za-z_0-9]+)\(")
_JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}")


def written_calls(text: str) -> list[tuple[str, ast.Call, int]]:
    """(operator, parsed call, line) for each ``torch_npu.op(...)`` whose text parses."""
    out = []
    for match in _CALL.finditer(text):
        name = match.group(1)
        end = _closing_paren(text, match.end() - 1)
        if name not in SCHEMAS or end is None:
            continue
        snippet = _JINJA.sub("x", text[match.start() : end + 1])
        snippet = re.sub(r"\s*\n\s*", " ", snippet)
        try:
            call = ast.parse(snippet, mode="eval").body
        except SyntaxError:
            continue  # prose such as "torch_npu.op(...)" or a signature line
        if isinstance(call, ast.Call):
            out.append((name, call, text.count("\n", 0, match.start()) + 1))
    return out


def _closing_paren(text: str, start: int) -> int | None:
    depth = 0
    for i in range(start, min(len(text), start + 4000)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return None


def binding_errors(name: str, call: ast.Call) -> list[str]:
    schema = SCHEMAS[name]
    positional = [p.name for p in schema.params if not p.keyword_only]
    errors = []
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return errors  # *args / **kwargs: cannot be read statically
    if len(call.args) > len(positional):
        errors.append(f"{len(call.args)} positional arguments, the schema takes {len(positional)}")
    for kw in call.keywords:
        if kw.arg not in schema.names:
            errors.append(f"keyword `{kw.arg}` is not in the schema")
        elif kw.arg in positional[: len(call.args)]:
            errors.append(f"`{kw.arg}` given positionally and by keyword")
    return errors


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_written_calls_bind_under_the_schema(path):
    text = path.read_text()
    problems = [
        f"{path.name}:{line}: torch_npu.{name}: {error}"
        for name, call, line in written_calls(text)
        for error in binding_errors(name, call)
    ]
    assert problems == []


def test_the_reader_finds_the_calls_and_their_faults():
    text = (
        "torch_npu.scatter_update_(data=k_cache, indices=i, updates=u, axis=-2)\n"
        "torch_npu.npu_format_cast(x, 29, 1)\n"
        "out, _ = torch_npu.npu_fused_infer_attention_score(\n"
        "    q, k, v, num_heads={{ heads }}, input_layout='TND')\n"
    )
    found = written_calls(text)
    assert [(name, line) for name, _, line in found] == [
        ("scatter_update_", 1),
        ("npu_format_cast", 2),
        ("npu_fused_infer_attention_score", 3),
    ]
    assert binding_errors(*found[0][:2]) == ["keyword `data` is not in the schema"]
    assert binding_errors(*found[1][:2]) == ["3 positional arguments, the schema takes 2"]
    assert binding_errors(*found[2][:2]) == []


def test_the_sources_hold_calls_of_the_operators_kvskill_emits():
    names = {name for path in SOURCES for name, _, _ in written_calls(path.read_text())}
    assert {
        "npu_fused_infer_attention_score",
        "npu_fused_infer_attention_score_v2",
        "npu_scatter_nd_update_",
        "scatter_update_",
        "npu_kv_rmsnorm_rope_cache",
    } <= names
