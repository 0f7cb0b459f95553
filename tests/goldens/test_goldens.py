"""The implementer's outputs are frozen: a conversion changes only when a commit means it to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import GOLDEN_MODEL_TYPES, GOLDEN_ROOT, golden_files, recorded_files  # noqa: E402

pytestmark = pytest.mark.skipif(
    not GOLDEN_ROOT.is_dir(),
    reason=f"no goldens recorded for this transformers version ({GOLDEN_ROOT.name})",
)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", GOLDEN_MODEL_TYPES)
def test_apply_writes_exactly_the_recorded_output(model_type: str, tmp_path: Path) -> None:
    recorded = recorded_files(model_type)
    assert recorded, f"no goldens for {model_type}: run scripts/record_goldens.py {model_type}"
    produced = golden_files(model_type, tmp_path)
    assert sorted(produced) == sorted(recorded)
    for name, text in produced.items():
        assert text == recorded[name], (
            f"{name} differs from its golden; if the change is intended, run "
            f"scripts/record_goldens.py {model_type} and explain it in the commit"
        )
