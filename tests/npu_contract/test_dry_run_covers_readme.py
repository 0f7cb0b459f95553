"""The fake-NPU dry run covers exactly the families of the README's supported-models table."""

from __future__ import annotations

import re
from pathlib import Path

from test_fake_npu_dry_run import FAMILIES, MODES, REMOTE

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_families() -> set[str]:
    text = README.read_text(encoding="utf-8")
    table = text.split("<!-- supported-models:start -->", 1)[1].split(
        "<!-- supported-models:end -->"
    )[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    names = set()
    for row in rows[1:]:  # after the header
        first = row.split("|")[1].strip()
        found = re.match(r"`(\w+)`", first)
        names.add(found.group(1) if found else REMOTE if first.startswith("remote code") else first)
    return names


def test_every_supported_family_and_only_those_run_in_the_dry_run():
    assert readme_families() == set(FAMILIES)


def test_the_dry_run_covers_framework_and_both_standalone_modes():
    assert MODES == ("framework", "standalone-paged", "standalone-contiguous")
