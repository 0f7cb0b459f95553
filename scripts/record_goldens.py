"""Record the golden outputs of ``kvskill apply`` (tests/goldens/<transformers version>/).

    .venv/bin/python scripts/record_goldens.py             # every type of GOLDEN_MODEL_TYPES
    .venv/bin/python scripts/record_goldens.py llama gemma2

Run it only after a change that is meant to alter a conversion, and say in the commit what
changed and why; tests/goldens/test_goldens.py compares the implementer against these files.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "goldens"))

from outputs import GOLDEN_MODEL_TYPES, GOLDEN_ROOT, golden_files  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", default=list(GOLDEN_MODEL_TYPES))
    args = parser.parse_args()
    GOLDEN_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for model_type in args.model_types:
            for old in GOLDEN_ROOT.glob(f"{model_type}.*"):
                if old.name.split(".")[0] == model_type:
                    old.unlink()
            for name, text in golden_files(model_type, Path(scratch)).items():
                (GOLDEN_ROOT / name).write_text(text, encoding="utf-8")
                print(f"wrote {GOLDEN_ROOT.relative_to(ROOT) / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
