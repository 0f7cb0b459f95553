"""Write the Plan's JSON Schema into references/plan_schema.md (the block after its marker).

    .venv/bin/python scripts/write_plan_schema.py

Run it after a change to the Plan's fields; tests/analyzer/test_plan_schema.py fails until the
page holds the schema ``kvskill analyze --schema`` prints.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvskill.analyzer.plan_schema import plan_schema

PAGE = Path(__file__).resolve().parents[1] / "references" / "plan_schema.md"
MARKER = "<!-- the schema below is written by scripts/write_plan_schema.py -->"


def schema_block() -> str:
    return "```json\n" + json.dumps(plan_schema(), indent=2) + "\n```\n"


def main() -> int:
    text = PAGE.read_text(encoding="utf-8")
    head = text[: text.index(MARKER) + len(MARKER)]
    PAGE.write_text(head + "\n\n" + schema_block(), encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
