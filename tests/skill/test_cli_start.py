"""The CLI starts without torch: an agent makes dozens of calls per model, and importing torch
costs seconds each time. Commands load torch, transformers and the runtime only when their
work needs them.

Each call runs in a fresh interpreter (a forked CLI would inherit the server's imports) and
reports which heavy packages ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HEAVY = ("torch", "transformers", "kvskill.runtime", "kvskill.verify.flow")

_PROBE = """
import json, sys
from kvskill.entry import main
heavy = sys.argv.pop(1)
try:
    main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
else:
    code = 0
print(json.dumps({"code": code, "loaded": [m for m in json.loads(heavy) if m in sys.modules]}), file=sys.stderr)
"""


def _loaded_after(*args: str) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(HEAVY), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    last = done.stderr.strip().splitlines()[-1]
    report = json.loads(last)
    return report["code"], report["loaded"]


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("--version",),
        ("apply", "--help"),
        ("verify", "--help"),
        ("run", "--help"),
        ("lint", str(FIXTURES / "toy_model" / "modeling_toy.py")),
        ("lint", "--format", "json", str(FIXTURES / "mla_toy_modeling.py")),
    ],
    ids=lambda a: " ".join(Path(x).name if "/" in x else x for x in a),
)
def test_help_and_lint_load_no_torch(args):
    code, loaded = _loaded_after(*args)
    assert code in (0, 1), code  # lint exits 1 when it finds something
    assert loaded == [], f"kvskill {' '.join(args)} imported {loaded}"


def test_a_command_that_needs_torch_still_gets_it(tmp_path):
    """The probe would pass vacuously if nothing ever loaded torch: a bad verify directory is
    answered before the model runs, but verify's imports are made by then."""
    code, loaded = _loaded_after("verify", str(tmp_path))
    assert code == 2
    assert "torch" in loaded and "kvskill.verify.flow" in loaded
