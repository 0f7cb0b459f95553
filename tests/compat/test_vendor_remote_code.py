"""The vendor-shape model directories (tests/fixtures/vendor/) under the installed transformers.

They are written in the style of remote code for transformers 4.3x-4.4x (tuple caches grown
with torch.cat, fused projections, heads not named lm_head, no logits_to_keep), so the locks
of that era are where they belong; the main suite runs them under 5.x as well.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.compat.roundtrip import MODES, assert_token_exact, round_trip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from vendor_fixtures import MLA_VENDOR_FIXTURES, VENDOR_FIXTURES, VENDOR_ROOT  # noqa: E402

pytestmark = [pytest.mark.compat, pytest.mark.slow]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(VENDOR_FIXTURES))
def test_vendor_shape_is_token_exact(name, mode, tmp_path):
    report = round_trip(str(VENDOR_ROOT / name), tmp_path / mode, mode, trust_remote_code=True)
    assert_token_exact(report)


@pytest.mark.parametrize("name", sorted(MLA_VENDOR_FIXTURES))
def test_mla_vendor_shape_is_token_exact(name, tmp_path):
    # framework mode only: the absorbed MLA path has no standalone mode 1 (refused), and its
    # standalone mode 3 runs the same attention code (checked in the main suite)
    report = round_trip(str(VENDOR_ROOT / name), tmp_path / "framework", trust_remote_code=True)
    assert_token_exact(report)
