"""The project's transformers-4-style remote-code model, under the installed transformers."""

from __future__ import annotations

import pytest
from remote_model import write_remote_model

from tests.compat.roundtrip import assert_token_exact, round_trip

pytestmark = [pytest.mark.compat, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["framework", "standalone"])
def test_remote_model_is_token_exact(mode, tmp_path):
    source = write_remote_model(tmp_path / "tiny_remote")
    report = round_trip(str(source), tmp_path / mode, mode, trust_remote_code=True)
    assert_token_exact(report)
