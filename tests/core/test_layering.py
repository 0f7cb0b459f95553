"""The dependency direction of the design: the floor imports nothing of ours, the analyzer and
the runtime import only the floor (and themselves), the implementer the analyzer (never the
runtime it writes code for), verify everything below the CLI, and exactly one AttnType
exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# folder -> the kvskill packages its modules may import
ALLOWED = {
    "core": {"kvskill.core"},
    # the analyzer reads configs and code; it never runs a model, so neither the runtime nor
    # the rewrite (the CLI asks the implementer whether apply would refuse a Plan)
    "analyzer": {"kvskill.core", "kvskill.analyzer"},
    # the rewrite reads the Plan and the analyzer's code facts; it runs no model, so neither
    # the runtime nor verify (``from kvskill.runtime import ...`` in emitted code is text)
    "implementer": {"kvskill.core", "kvskill.analyzer", "kvskill.implementer"},
    # verify runs both models: the original, and the converted one on the runtime
    "verify": {
        "kvskill.core",
        "kvskill.analyzer",
        "kvskill.implementer",
        "kvskill.runtime",
        "kvskill.verify",
    },
    "runtime": {"kvskill.core", "kvskill.runtime"},
}


def _kvskill_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name == "kvskill" or name.startswith("kvskill.")}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_lies_below_it(folder: str) -> None:
    allowed = ALLOWED[folder]
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _kvskill_imports(path):
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_one_attn_type_enum_is_shared_by_every_part() -> None:
    from kvskill import core, runtime

    assert runtime.AttnType is core.AttnType
    defining = [
        path.relative_to(ROOT)
        for folder in ("core", "analyzer", "implementer", "verify", "runtime", "skill")
        for path in (ROOT / folder).rglob("*.py")
        if "class AttnType(" in path.read_text(encoding="utf-8")
    ]
    assert defining == [Path("core/attn_types.py")]
