"""Shared fixtures for the implementer tests: converted families, built once per session.

Converting and verifying a family takes a few seconds, so every test that needs a converted
directory (verify per family, mutations, idempotence) shares these; tests that change a
directory copy it first.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from remote_model import write_remote_model  # noqa: E402

#: the families of the installed transformers every release must convert token-exact
FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    # hybrid: gated delta net layers (Mamba group) between full-attention layers
    "qwen3_next",
)
REMOTE = "tiny_remote"


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    # Tiny matmuls are slower with several threads on a shared 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class Converted:
    """Lazily converts (and verifies) each family once, under one session directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._reports: dict[str, object] = {}

    def remote_source(self) -> Path:
        return write_remote_model(self.root / "sources" / REMOTE)

    def directory(self, family: str) -> Path:
        from kvskill.implementer.writer import ApplyOptions, apply_model

        if family not in self._dirs:
            model = str(self.remote_source()) if family == REMOTE else family
            out = self.root / "converted" / family
            apply_model(model, out, ApplyOptions())
            self._dirs[family] = out
        return self._dirs[family]

    def copy(self, family: str, dest: Path) -> Path:
        """A private copy of a converted directory, for tests that change it."""
        shutil.copytree(self.directory(family), dest, symlinks=True)
        return dest

    def report(self, family: str):
        from kvskill.verify.flow import verify_directory
        from kvskill.verify.options import VerifyOptions

        if family not in self._reports:
            self._reports[family] = verify_directory(
                self.directory(family), VerifyOptions(trust_remote_code=True)
            )
        return self._reports[family]


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Converted:
    return Converted(tmp_path_factory.mktemp("implementer"))
