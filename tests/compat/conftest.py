"""The compatibility suite (``pytest -m compat``): ``make test-compat`` runs it in one venv
per transformers lock (constraints-transformers-*.txt)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# the implementer tests' remote-code model is one of the suite's fixtures
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "implementer"))


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    # Tiny matmuls are slower with several threads on a shared 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
